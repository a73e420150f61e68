"""The engine: the Llama-4 MoE model, checkpoint and tokenizer loading, and the loop that serves it.

Sub-packages name its parts (docs/design.md, "Layout and layering", gives the order they import in,
lowest first): model/, checkpoint/, sampling/ (with structured outputs' grammars), requests/ (requests,
sequences, a scheduled sequence), runner/ (the model runner and decode graphs), observers/ (routing tap,
trace recorder, expert load), policies/ (micro-batch grouping), core/ (the engine loop, scheduler, KV
blocks, the step), ep/ (expert parallelism), frontend/ (build_engine, LLM, AsyncEngine).
"""
