"""``opforge doctor``'s probes of the build cache (its entries, locks, owner
and mode) and of the op library a new process would load, by which route."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from opforge.builder import store as build_cache
from opforge.builder.config import library_config
from opforge.builder.errors import BuildError
from opforge.builder.jit import cache_root, complete_library
from opforge.builder.prebuilt import choose_prebuilt, library_file
from opforge.builder.store import CacheDirError
from opforge.builder.toolchain import Problem


@dataclass
class CacheEntry:
    name: str
    state: str  # "complete", "objects", "building" or "incomplete"
    size_bytes: int
    note: str = ""


@dataclass
class LockFile:
    name: str
    held: bool | None  # None: could not be tested
    holder: str | None = None
    note: str = ""


@dataclass
class CacheInfo:
    path: str = ""
    exists: bool = False
    size_bytes: int = 0
    mode: str | None = None
    owner_uid: int | None = None
    entries: list[CacheEntry] = field(default_factory=list)
    locks: list[LockFile] = field(default_factory=list)


@dataclass
class LibraryInfo:
    route: str = "JIT"  # "prebuilt" (opforge._C from pip install), "JIT" (built into the cache) or "OPFORGE_LIBRARY"
    prebuilt: str = ""  # why the prebuilt library is, or is not, the one loaded
    key: str | None = None
    entry: str | None = None
    entry_path: str | None = None
    state: str = "unknown"  # "built", "building", "incomplete", "corrupt", "not built", "unknown"
    with_cuda: bool | None = None
    loaded_path: str | None = None
    note: str = ""


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            # A file removed while we walk it is a build cleaning up.
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def _lock_state(path: Path) -> LockFile:
    lock = LockFile(name=path.name, held=None)
    try:
        # flock works on a read-only descriptor, so testing never needs (or
        # changes) write access to someone's lock file.
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        lock.note = f"cannot open it to test: {exc.strerror}"
        return lock
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.held = True
            text = os.pread(fd, 200, 0).decode(errors="replace").strip()
            lock.holder = text or None
            lock.note = f"held: a build is in progress ({text or 'holder unknown'}{_pid_note(text)})"
            return lock
        fcntl.flock(fd, fcntl.LOCK_UN)
        lock.held = False
        lock.note = "free: harmless (a kernel flock dies with its holder, so it cannot go stale)"
        return lock
    finally:
        os.close(fd)


def _pid_note(holder: str) -> str:
    m = re.fullmatch(r"pid (\d+)", holder)
    if not m:
        return ""
    try:
        os.kill(int(m[1]), 0)
    except ProcessLookupError:
        return ", not a process here: another container or machine sharing the cache"
    except PermissionError:
        return ", another user's process"
    return ""


def probe_cache(problems: list[Problem]) -> CacheInfo:
    """The build cache: where, owner and mode, each entry and each lock."""
    env = os.environ.get("OPFORGE_CACHE_DIR")
    info = CacheInfo(path=env or str(Path.home() / ".cache" / "opforge"))
    try:
        # The call a build makes (creates the directory, mode 0700, if missing);
        # whether it can be written is said below, with its owner and mode.
        root = cache_root(write=False)
    except CacheDirError as exc:
        problems.append(Problem("error", exc.problem, exc.fix))
        return info
    info.path, info.exists = str(root), root.is_dir()
    st = root.stat()
    info.mode, info.owner_uid = f"{stat.S_IMODE(st.st_mode):04o}", st.st_uid
    if st.st_uid != os.geteuid():
        problems.append(
            Problem(
                "error",
                f"the cache directory {root} belongs to uid {st.st_uid}, not you (uid {os.geteuid()}): "
                "its owner controls the libraries this process loads",
                f"use a cache of your own: export OPFORGE_CACHE_DIR=~/.cache/opforge (or chown {os.geteuid()} {root} && chmod 700 {root})",
            )
        )
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        # An error, not a warning: `import opforge` refuses to load from it (check_safe_to_load).
        problems.append(
            Problem(
                "error",
                f"the cache directory {root} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
                f"(mode {info.mode}): they could replace the libraries this process loads, so opforge refuses to load them",
                f"chmod 700 {root}",
            )
        )
    if not os.access(root, os.W_OK | os.X_OK):
        problems.append(
            Problem("error", f"the cache directory {root} is not writable by you", f"chmod 700 {root}, or set OPFORGE_CACHE_DIR")
        )

    locks = {p.name: _lock_state(p) for p in sorted(root.glob("*.lock")) if p.is_file()}
    info.locks = list(locks.values())
    for e in build_cache.entries(root):
        entry = CacheEntry(name=e.path.name, state="complete", size_bytes=e.size)
        lock = locks.get(f"{e.path.name}.lock")
        if lock is not None and lock.held:
            # Builds lock the object directory they compile in.
            entry.state, entry.note = "building", f"being built now ({lock.holder or 'holder unknown'})"
        elif e.objects:
            entry.state, entry.note = "objects", "object files kept for incremental rebuilds"
        elif not e.complete:
            entry.state = "incomplete"
            entry.note = "debris of a failed or killed build; the next build of it wipes it"
        if entry.state != "complete" and (e.path / "build.log").is_file():
            entry.note += f"; the failure is in {e.path / 'build.log'}"
        info.entries.append(entry)
    info.size_bytes = _tree_size(root)
    return info


def probe_library(problems: list[Problem], cache: CacheInfo) -> LibraryInfo:
    """The op library a new process would load, by which route, and its state."""
    info = LibraryInfo()
    mod = sys.modules.get("opforge")
    loaded = getattr(mod, "library", None)
    if loaded is not None:
        info.loaded_path = str(loaded.path)
    try:
        so, info.prebuilt = choose_prebuilt()
        named = library_file()
    except BuildError as exc:
        problems.append(
            Problem("error", str(exc).removeprefix("opforge: "), "set OPFORGE_LIBRARY to auto, prebuilt, jit or the path of an op library")
        )
        so, info.prebuilt, named = None, str(exc), None
    if named is not None:
        info.route, info.entry, info.entry_path = "OPFORGE_LIBRARY", named.name, str(named)
        info.state = "built" if named.is_file() else "missing"
        if not named.is_file():
            problems.append(
                Problem("error", f"OPFORGE_LIBRARY={named} names no file", "build it (cmake --build build), or unset OPFORGE_LIBRARY")
            )
        if info.loaded_path and Path(info.loaded_path) != named:
            info.note = "the loaded library is not the one a new process would load: the environment changed since"
        return info
    if so is not None:
        info.route, info.state, info.entry, info.entry_path = "prebuilt", "built", so.name, str(so)
        info.with_cuda = "CUDA kernels" in info.prebuilt
        if info.loaded_path and Path(info.loaded_path) != so:
            info.note = "the loaded library is not the one a new process would load: the sources or environment changed since"
        return info
    try:
        cfg = library_config()
        key = cfg.key()
    except BuildError as exc:
        # want_cuda()'s refusal is already reported by the GPU section.
        if "OPFORGE_BUILD_CUDA" not in str(exc):
            problems.append(Problem("error", str(exc).removeprefix("opforge: "), "reinstall opforge, or fix the source tree"))
        info.note = "cannot say which library would be loaded"
        return info
    info.key, info.with_cuda = key, cfg.with_cuda
    info.entry = f"{cfg.name}-{key[:16]}"
    entry = Path(cache.path) / info.entry
    info.entry_path = str(entry)
    state = {e.name: e for e in cache.entries}.get(info.entry)
    if state is None:
        info.state, info.note = "not built", "the next `import opforge` (or `opforge build`) builds it"
    elif state.state == "complete":
        # The checksum is what load_library checks too: a library changed after
        # its build is rebuilt, not loaded.
        if complete_library(entry) is not None:
            info.state = "built"
        else:
            info.state, info.note = "corrupt", "its library does not match its checksum; the next build replaces it"
    else:
        info.state, info.note = state.state, state.note
    if info.loaded_path and Path(info.loaded_path).parent != entry:
        info.note = "the loaded library is not the one a new process would load: the sources or environment changed since"
    return info
