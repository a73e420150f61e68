"""Rank 0 and the other ranks of an expert-parallel server: how each is launched, its worker loop, rank 0's driver, and the control plane between them (docs/design.md, "Expert-parallel serving")."""
