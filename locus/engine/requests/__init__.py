"""What the engine's parts pass each other: a request, its sequences, and a sequence scheduled for a step.
Below the runner, the observers, the grouping policies and the loop, which all take them."""
