"""Scheduling policies: which scheduled sequences share a micro-batch (arrival order, or a placement
plan's grouper)."""
