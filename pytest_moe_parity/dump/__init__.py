"""Dumps: a candidate's outputs written to disk from inside its own process (`record`, `Recorder`:
`writer`), and read back by name, map file or NxDI capture table (`reader`, `nxdi_capture`) for
`--hw dump` and `moe-parity compare`."""

from __future__ import annotations

from .writer import Recorder, record

__all__ = ["Recorder", "record"]
