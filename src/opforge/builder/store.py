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
import stat
import sys
from collections.abc import Iterator
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


__all__ = ["CacheDirError", "cache_root", "exclusive", "read_json", "shared", "write_json"]
