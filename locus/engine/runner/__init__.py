"""From a scheduled micro-batch to a forward pass: the model runner, and the decode graphs over static
input buffers."""
