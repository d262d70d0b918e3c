"""The golden store: the recorded call format (`spec`), the writer and the reader of a golden
directory (one safetensors file per layer, read one point at a time)."""

from .store import MANIFEST, SCHEMA_VERSION, GoldenError, GoldenRecord, GoldenStore
from .writer import GoldenWriter, Recorded

__all__ = ["MANIFEST", "SCHEMA_VERSION", "GoldenError", "GoldenRecord", "GoldenStore", "GoldenWriter", "Recorded"]
