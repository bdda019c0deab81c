"""The build cache: what is in it, and cleaning it without breaking a build in
progress. Under cache_root(): finished libraries, one directory
``<name>-<16 hex of its key>`` each, and the object directories they were built
in, ``<name>-<16 hex>.objects``, each beside its lock file ``<dir>.lock``."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from opforge.builder.store import cache_root

_ENTRY = re.compile(r"^(?P<name>.+)-(?P<key>[0-9a-f]{16})(?P<objects>\.objects)?$")


@dataclass(frozen=True)
class Entry:
    path: Path
    name: str
    key: str
    complete: bool  # the build finished (its marker exists); else debris the next build wipes
    size: int  # bytes on disk
    last_used: float  # epoch seconds: the last load or build
    build_seconds: float | None
    objects: bool = False  # an object directory, kept for incremental rebuilds, not a library


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def entries(root: Path | None = None) -> list[Entry]:
    """Everything in the cache: libraries (JIT, setuptools and cmake builds of
    user folders too), object directories, and ``inline/``'s source folders."""
    root = root or cache_root(write=False)
    found = []
    inline = root / "inline"
    for d in sorted(inline.iterdir()) if inline.is_dir() else ():
        m = _ENTRY.match(d.name)
        if d.is_dir() and m:
            # Written sources are whole from the start (each file is renamed into place).
            found.append(Entry(d, f"inline/{m['name']}", m["key"], True, _size(d), d.stat().st_mtime, None))
    for d in sorted(root.iterdir()):
        m = _ENTRY.match(d.name)
        if not d.is_dir() or not m:
            continue
        marker = d / "COMPLETE.json"
        seconds = None
        try:
            seconds = json.loads(marker.read_text()).get("seconds")
            complete = True
        except (OSError, ValueError):
            # A cmake build directory has no marker of ours: configured is as complete as it gets.
            complete = (d / "CMakeCache.txt").is_file()
        found.append(Entry(d, m["name"], m["key"], complete, _size(d), d.stat().st_mtime, seconds, objects=bool(m["objects"])))
    return found


@contextlib.contextmanager
def _unless_busy(lock: Path) -> Iterator[bool]:
    """Yields True holding the entry's lock, False if a build holds it now."""
    with open(lock, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def clean(older_than_days: float | None = None, root: Path | None = None) -> tuple[list[Entry], list[Entry]]:
    """Removes entries (all, or those unused for ``older_than_days``); returns
    (removed, skipped because a build holds them). A process that has a removed
    library loaded keeps running: the file is unlinked, not overwritten."""
    root = root or cache_root()
    cutoff = None if older_than_days is None else time.time() - older_than_days * 86400
    removed, busy = [], []
    for e in entries(root):
        if cutoff is not None and e.last_used >= cutoff:
            continue
        lock = e.path.parent / f"{e.path.name}.lock"
        with _unless_busy(lock) as free:
            if not free:
                busy.append(e)
                continue
            shutil.rmtree(e.path, ignore_errors=True)
        lock.unlink(missing_ok=True)
        removed.append(e)
    return removed, busy


# The eager fast path's background build writes here; the build removes it when it works, the
# process that started it when it fails. A failed build whose starter had exited leaves it.
_FAST_BUILD_LOG = re.compile(r"^opforge_fast-build-(?P<pid>\d+)\.log$")


def fast_build_log(root: Path, pid: int) -> Path:
    """The log of the fast path's background build started by process ``pid``."""
    return root / f"opforge_fast-build-{pid}.log"


def failed_build_logs(root: Path | None = None) -> list[Path]:
    """The logs of the fast path's background builds that no process will read:
    their starter has exited (a live one still reads its build's log), and no
    build of the fast path is running (one that outlived its starter removes
    its log when it works)."""
    root = root or cache_root(write=False)
    if not root.is_dir() or _fast_path_building(root):
        return []
    logs = []
    for f in sorted(root.iterdir()):
        m = _FAST_BUILD_LOG.match(f.name)
        if m and f.is_file() and not _alive(int(m["pid"])):
            logs.append(f)
    return logs


def _fast_path_building(root: Path) -> bool:
    for lock in root.glob("opforge_fast-*.lock"):
        with _unless_busy(lock) as free:
            if not free:
                return True
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def clean_failed_build_logs(older_than_days: float | None = None, root: Path | None = None) -> list[Path]:
    """Removes ``failed_build_logs`` (all, or those older than ``older_than_days``); returns them."""
    cutoff = None if older_than_days is None else time.time() - older_than_days * 86400
    removed = []
    for log in failed_build_logs(root or cache_root()):
        if cutoff is not None and log.stat().st_mtime >= cutoff:
            continue
        log.unlink(missing_ok=True)
        removed.append(log)
    return removed
