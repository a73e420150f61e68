"""Locus: an MoE inference server for multi-node expert parallelism.

Packages, lowest layer first (a lower layer never imports a higher one):
kernels, traces < routing < engine < server.
"""

__version__ = "0.1.0"
