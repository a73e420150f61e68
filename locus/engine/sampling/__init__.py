"""Sampling: request parameters and their ranges, the batched sampler (logit processing in vLLM's order,
seeded draws) and logprobs."""
