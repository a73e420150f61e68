"""Everything about where tokens' experts are, below the engine.

- `gate.py`: router math (logits -> top-k experts and weights);
- `dispatch_rule.py`: which rank and slot serve a token's (layer, expert) pair, one rule for the
  runtime and the replay;
- `plan/`: the placement plan format (topology, slots, balance caps, the grouper's spec);
- `planners/`: round_robin and eplb baselines, the locality planner and its parts, `locus plan`;
- `grouping/`: the online micro-batch grouper (request -> node, rank) and its offline simulation;
- `replay/`: what a plan and an assignment cost on a recorded trace (`locus replay`);
- `ep/`: the expert-parallel runtime's exchange (two-tier all-to-all on torch.distributed).
"""
