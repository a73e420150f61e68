"""Replay: what a placement plan and a request assignment cost on a recorded trace."""
