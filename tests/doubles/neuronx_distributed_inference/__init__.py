"""A test double of neuronx-distributed-inference: only what `--hw nxdi` calls, with the documented
contracts enforced (see ../../../../shared/NEURON.md sections 2.1, 3.1-3.3) and CPU numerics that
follow the documented ones (router in float32 with a float64 softmax over every expert, top-k
affinities renormalised in the experts, experts fused as gate_up [E, H, 2I] and down [E, I, H]).
Not NxDI: a port of its interfaces, for CI."""
