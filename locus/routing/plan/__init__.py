"""The placement plan format: topology, which experts each rank holds (and so each node's replicas), balance
caps, the grouper's spec and the prompt predictor stored in it."""
