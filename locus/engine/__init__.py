"""The engine: the Llama-4 MoE model, checkpoint and tokenizer loading, and the loop that serves it.

Sub-packages name its parts (docs/design.md, "Layout and layering"): core/ (the engine loop,
scheduler, KV blocks, sequences, step pipeline), sampling/, structured/ (grammars), runner/ (the model
runner and decode graphs), policies/ (micro-batch grouping), frontend/ (build_engine, LLM,
AsyncEngine), model/, checkpoint/, observers/ (routing tap, trace recorder, expert load) and ep/ (expert
parallelism).
"""
