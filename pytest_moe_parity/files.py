"""Files written whole or not at all: a reader sees the old file or the new one, never half of one
(the golden's manifest and groups, reports, a compile cache's records, noise figures); and the
per-architecture JSON tables (NxDI's capture names, NxDI's modules) read one way."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """`text` written to a temporary file beside `path`, synced, and moved onto it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_replace(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write, moved onto `path` when the block ends cleanly (and
    removed when it does not): a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def file_mode() -> int:
    """The mode a new file gets here (0o644 less the process's umask)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o644 & ~mask


def table_names(directory: Path) -> list[str]:
    """The architectures a directory of per-architecture JSON tables covers."""
    return sorted(p.stem for p in directory.glob("*.json"))


def read_table(directory: Path, model_type: str) -> dict[str, Any] | None:
    """An architecture's JSON table from `directory` (its "source" line is documentation), or None."""
    path = directory / f"{model_type}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    data.pop("source", None)
    return data
