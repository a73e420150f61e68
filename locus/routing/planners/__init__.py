"""Placement planners: the baselines (round_robin, eplb) and the locality planner with its parts."""
