"""The Llama-4 MoE model, checkpoint and tokenizer loading, KV cache, and the engine loop."""
