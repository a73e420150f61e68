"""Getting a model into memory: HuggingFace-format checkpoints, seeded presets, tokenizers, and the
`--model DIR|preset` resolver."""
