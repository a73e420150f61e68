"""Everything about where tokens' experts are, below the engine. Its parts import one way, lowest first
(docs/design.md, "Layout and layering"):

- `gate.py`: router math (logits -> top-k experts and weights);
- `node_cover.py`: the fewest nodes that hold a token's experts (the node-aware rule's choice);
- `plan/`: the placement plan format (topology, slots, balance caps, the grouper's spec and predictor);
- `expert_groups.py`: group-limited routing's expert groups and the nodes they bound a token to;
- `dispatch_rule.py`: which rank and slot serve a token's (layer, expert) pair, one rule for the
  runtime and the replay;
- `replay/`: what a plan and an assignment cost on a recorded trace (`locus replay`);
- `grouping/`: the online micro-batch grouper (request -> node, rank) and its offline simulation;
- `planners/`: round_robin and eplb baselines, the locality planner and its parts, `locus plan`.
The expert-parallel runtime that moves tokens is the engine's (locus/engine/ep/).
"""
