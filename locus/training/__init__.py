"""Training a small Llama-4-style MoE on a corpus built from installed packages (`locus train`).

corpus.py      domain-tagged documents from Debian/PyPI package files, a fixed held-out split, sources
tokenizer.py   a byte-level BPE trained with `tokenizers`, with Locus's Llama-4 special tokens
train.py       the training loop (Locus's own Llama4ForCausalLM, plain PyTorch), checkpoints, model card
"""
