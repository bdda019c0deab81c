"""Several libraries built at once: a setup.py's extensions, each built by the
JIT engine (cache, lock, progress, compiler errors) in a worker process of its own.

Processes, not threads: torch's builder keeps state per process (the versions
of what it built, the compiler variables the toolchain sets) and loads each
library it builds, so two builds in one process would step on each other. The
builds share ``jobs()`` compile jobs (``MAX_JOBS``, else the CPU cores this
process may use): at most that many run at once, and each gets its share as
its own ``MAX_JOBS``. Their output is passed on line by line as it comes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from opforge.builder.child import popen
from opforge.builder.errors import BuildError
from opforge.builder.jit import BuildConfig, Library, build_library, cached_path

# Run as `python -c _WORKER CONFIGS_JSON RESULTS_JSON QUIET`: builds each config in turn.
_WORKER = """
import dataclasses, json, sys
from pathlib import Path
from opforge.builder.errors import BuildError
from opforge.builder.jit import BuildConfig, build_library
configs, out, quiet = json.loads(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
paths = {f.name for f in dataclasses.fields(BuildConfig) if "Path" in str(f.type)}
results = []
for raw in configs:
    cfg = BuildConfig(**{k: tuple(map(Path, v)) if k in paths else tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    try:
        lib = build_library(cfg, quiet=quiet)
        results.append({"path": str(lib.path), "key": lib.key, "with_cuda": lib.with_cuda, "built_now": lib.built_now,
                        "build_seconds": lib.build_seconds})
    except BuildError as exc:
        results.append({"error": str(exc)})
    out.write_text(json.dumps(results))
"""


def jobs() -> int:
    """The compile jobs builds may run at once: ``MAX_JOBS`` (torch's variable), else this process's CPU cores."""
    value = os.environ.get("MAX_JOBS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def build_libraries(cfgs: Sequence[BuildConfig], *, quiet: bool = False) -> list[Library]:
    """Each of ``cfgs`` built, or found in the cache, in their order. Where
    more than one must be built, they build at once in worker processes
    (see the module's doc), each worker taking its turn of them (one import of
    torch a worker). A BuildError names every build that failed."""
    todo = list(dict.fromkeys(cfg for cfg in cfgs if cached_path(cfg) is None))
    total = jobs()
    if len(todo) <= 1 or total == 1:  # one at a time: in this process, as any build
        return [build_library(cfg, quiet=quiet) for cfg in cfgs]
    workers = min(len(todo), total)
    share = max(1, total // workers)
    turns = [todo[i::workers] for i in range(workers)]
    if not quiet:
        print(
            f"opforge: building {len(todo)} libraries, {workers} at once ({share} compile job{'s' if share != 1 else ''} "
            f"each, MAX_JOBS={total} in all)",
            file=sys.stderr,
            flush=True,
        )
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(lambda turn: _in_worker(turn, share, quiet=quiet), turns)
        done = {cfg: r for turn, got in zip(turns, results, strict=True) for cfg, r in zip(turn, got, strict=True)}
    failed = [r for r in done.values() if isinstance(r, BuildError)]
    if failed:
        raise BuildError("\n\n".join(str(e) for e in failed))
    return [r if isinstance(r := done.get(cfg), Library) else build_library(cfg, quiet=quiet) for cfg in cfgs]


def _in_worker(cfgs: list[BuildConfig], max_jobs: int, *, quiet: bool) -> list[Library | BuildError]:
    """``cfgs`` built in turn by one worker process: each one's Library, or the BuildError it met."""
    raw = [{f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)} for cfg in cfgs]
    src = str(Path(__file__).resolve().parents[2])  # opforge's own package, wherever this process found it
    env = {
        **os.environ,
        "MAX_JOBS": str(max_jobs),
        "OPFORGE_NO_AUTOLOAD": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p),
    }
    with tempfile.TemporaryDirectory(prefix="opforge-build-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-c", _WORKER, json.dumps(raw), str(result), "1" if quiet else "0"]
        proc = popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail: list[str] = []
        relay = threading.Thread(target=_relay, args=(proc, tail, quiet), daemon=True)
        relay.start()
        rc = proc.wait()
        relay.join()
        found = json.loads(result.read_text()) if result.is_file() else []
    out: list[Library | BuildError] = [
        BuildError(r["error"]) if "error" in r else Library(Path(r["path"]), r["key"], r["with_cuda"], r["built_now"], r["build_seconds"])
        for r in found
    ]
    shown = "".join(tail[-20:]).rstrip()
    for cfg in cfgs[len(found) :]:  # the worker died before it got to them
        out.append(BuildError(f"opforge: building {cfg.name} failed in its worker process (exit {rc}):\n{shown}"))
    return out


def _plain(value: object) -> object:
    return [str(v) for v in value] if isinstance(value, tuple) else value


def _relay(proc: subprocess.Popen, tail: list[str], quiet: bool) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line)
        del tail[:-50]
        if not quiet:
            print(line, end="", file=sys.stderr, flush=True)


__all__ = ["build_libraries", "jobs"]
