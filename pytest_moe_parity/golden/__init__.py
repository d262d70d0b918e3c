"""The golden store: the recorded call format and one safetensors file per layer, read one point at a time."""
