"""pytest hooks of pytest-moe-parity (the only module that imports pytest)."""
