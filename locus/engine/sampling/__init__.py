"""Sampling: request parameters and their ranges, the batched sampler (logit processing in vLLM's order,
seeded draws), logprobs, and structured outputs: the grammars (xgrammar) that constrain what a sequence
may sample, and what compiling one may cost (grammar_limits.py)."""
