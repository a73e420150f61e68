"""The HTTP endpoints, one module per family; each module's `routes(state)` returns a FastAPI router
whose handlers serve that `ServerState`, and `create_app` (app.py) includes them."""
