"""The Llama-4 text MoE model: configuration, the decoder's modules, the forward batch and the KV
caches attention reads and writes. No parallelism here: expert parallelism is applied from outside
(locus/engine/ep/)."""
