"""The placement plan format: topology, which experts each rank holds, balance caps and the grouper's spec."""
