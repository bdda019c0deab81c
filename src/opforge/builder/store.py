"""Where the build cache lives and how its writers take turns.

Every cache writer (a library build, a precompiled header, a setuptools build)
holds a kernel ``flock`` on ``<entry>.lock`` while it writes ``<entry>``: the
kernel drops it when the holder exits or is killed, so a killed build never
leaves a lock that hangs the next one. ``opforge cache clean`` takes the same
lock without waiting and skips what is busy.

The build cache: what is in it, and cleaning it without breaking a build in
progress. Under cache_root(): finished libraries, one directory
``<name>-<16 hex of its key>`` each, and the object directories they were built
in, ``<name>-<16 hex>.objects``, each beside its lock file ``<dir>.lock``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import stat
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opforge.builder.errors import BuildError


class CacheDirError(BuildError):
    """The build cache directory cannot be used: ``problem`` names it, ``fix`` says what to do."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"opforge: {problem}: {fix}")
        self.problem, self.fix = problem, fix


def cache_root(*, write: bool = True) -> Path:
    """The per-user build cache (``OPFORGE_CACHE_DIR`` or ``~/.cache/opforge``),
    created (mode 0700) if missing. Raises CacheDirError when it is no
    directory or cannot be made, or cannot be read (``write``: and written)."""
    env = os.environ.get("OPFORGE_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "opforge"
    if env and not root.is_absolute():
        # Relative to the folder the command started in, for this process and every one it starts (a
        # build's child runs in the user's folder, where the same words would name another cache).
        root = Path.cwd() / root
        os.environ["OPFORGE_CACHE_DIR"] = env = str(root)
    named = f"OPFORGE_CACHE_DIR={env}" if env else f"the build cache {root}"
    fix = "set OPFORGE_CACHE_DIR to a directory you can write"
    if env and _system_directory(root):
        # The cache's entries are made and removed (opforge cache clean) among what is already there.
        raise CacheDirError(f"{named} is {root.resolve()}, a system directory or a filesystem's root", f"{fix}, such as ~/.cache/opforge")
    try:
        if root.exists() and not root.is_dir():
            raise CacheDirError(f"{named} is a file, not a directory", f"{fix} (or remove the file)")
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheDirError(f"{named} cannot be created ({exc.strerror or exc})", fix) from None
    wanted, what = (os.R_OK | os.W_OK | os.X_OK, "written") if write else (os.R_OK | os.X_OK, "read")
    if not _accessible(root, wanted):
        mode = f"{stat.S_IMODE(root.stat().st_mode):04o}"
        raise CacheDirError(f"{named} cannot be {what} by you (mode {mode})", f"chmod 700 {root}, or {fix}")
    return root


# Folders of the system that a cache must not be put straight into.
_SYSTEM = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/media", "/mnt", "/opt", "/proc", "/root",
           "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/usr/bin", "/usr/include", "/usr/lib", "/usr/lib64", "/usr/local",
           "/usr/local/bin", "/usr/local/lib", "/usr/sbin", "/usr/share", "/var", "/var/lib", "/var/tmp")  # fmt: skip


def _system_directory(root: Path) -> bool:
    """Whether ``root`` is a filesystem's root, a system folder, or the home folder itself."""
    resolved = root.resolve()
    return str(resolved) in _SYSTEM or resolved == Path.home().resolve() or resolved.parent == resolved


def _accessible(path: Path, mode: int) -> bool:
    # Apart from cache_root so that a test run as root (whom os.access lets
    # write anywhere) can stand in for a read-only directory.
    return os.access(path, mode)


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


__all__ = [
    "CacheDirError",
    "Entry",
    "cache_root",
    "clean",
    "clean_failed_build_logs",
    "entries",
    "exclusive",
    "failed_build_logs",
    "fast_build_log",
    "read_json",
    "shared",
    "write_json",
]
