"""What drives an engine: `build_engine` (assembles one for the server, the CLI and the benches), offline
`LLM`, and the server's background-thread `AsyncEngine` with the snapshots it serves the server (health.py)."""
