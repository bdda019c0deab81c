"""Where the build cache lives and how its writers take turns.

Every cache writer (a library build, a precompiled header, a setuptools build)
holds a kernel ``flock`` on ``<entry>.lock`` while it writes ``<entry>``: the
kernel drops it when the holder exits or is killed, so a killed build never
leaves a lock that hangs the next one. ``opforge cache clean`` takes the same
lock without waiting and skips what is busy.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """The per-user build cache (``OPFORGE_CACHE_DIR`` or ``~/.cache/opforge``)."""
    env = os.environ.get("OPFORGE_CACHE_DIR")
    root = Path(env) if env else Path.home() / ".cache" / "opforge"
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def exclusive(lock_path: Path, *, quiet: bool) -> Iterator[None]:
    """Holds the lock alone; says once on stderr whom it waits for."""
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            if not quiet:
                print(f"opforge: waiting for {holder} to finish building ({lock_path})", file=sys.stderr, flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}")
        fh.flush()
        try:
            yield
        finally:
            fh.seek(0)
            fh.truncate()
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def shared(lock_path: Path) -> Iterator[None]:
    """Holds the lock with other readers: an entry in use is never cleaned
    away or rebuilt under a compiler that reads it."""
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read_json(path: Path) -> Any:
    """The file's JSON, or None when it is missing or not whole."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: Any) -> None:
    """Writes through a temporary file and a rename: a reader sees the old
    file or the new one, never half of one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


__all__ = ["cache_root", "exclusive", "read_json", "shared", "write_json"]
