"""A test double of neuronx-distributed: the parallel layers --hw nxdi builds, on one rank (CPU)."""
