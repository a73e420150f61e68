"""The expert-parallel runtime: experts spread over ranks as a placement plan says, tokens sent to
them and back with torch.distributed all-to-all (see exchange.py). The engine applies it to a built
model from outside (locus/engine/expert_parallel.py)."""
