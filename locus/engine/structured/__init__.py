"""Structured outputs: grammars (xgrammar) that constrain what a sequence may sample, and what compiling
one may cost."""
