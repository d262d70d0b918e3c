"""pytest-moe-parity: layer-by-layer parity tests of ported MoE LLMs against a recorded golden run."""

__version__ = "0.1.0"
