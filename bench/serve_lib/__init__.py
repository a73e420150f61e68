"""The parts of bench/serve.py: prompts, the load client, the launched server, the offline run, the report."""
