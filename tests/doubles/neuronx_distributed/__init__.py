"""A test double of neuronx-distributed: the parallel layers --hw nxdi builds (each rank holding the
whole weight, except the attention, which computes its own heads), SPMDRank, and the all-reduce
between the ranks the double's build_module runs on threads (CPU)."""
