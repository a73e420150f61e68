"""Router math, placement plans, planners, grouper, replay and expert-parallel dispatch."""
