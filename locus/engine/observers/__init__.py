"""Subscribers to the engine's routing tap: the expert-load counters behind /metrics, the trace
recorder, and the plan's micro-batch grouper."""
