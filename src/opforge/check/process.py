"""``opforge check`` in a process of its own: a kernel that kills the process
(SIGFPE, SIGSEGV, an abort) or never returns ends that process, not the check.

One child process runs every check of every operator, as ``check.check_op``
does in-process, and before each step (one call of the operator on one
sample) writes to a pipe which operator, check and sample it runs; each check's
result follows it as it ends. When the child dies, or writes nothing for
longer than the time limit (it is then killed, with any process it started),
the step it was in is reported as that check's failure, naming the signal or
the time limit, and a new child goes on with the rest. The normal path costs
one child's start: importing torch and loading the operators again (about 2 s).

The child loads what this process loaded: opforge's op library if it is
loaded, and the spec files and package folders given (``Loads``). An operator
it cannot find there (a spec made in this process only) is checked here, in
this process.

A spec file runs a user's code as it loads (``opforge.spec`` calls each
operator once, on 3x5 inputs): ``trial_load`` loads it in a child first, and a
crash or a hang there is reported (``LoadCrash``, naming the operator whose
call it was) instead of loading the file into this process.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import opforge
from opforge.builder.child import end_children, popen
from opforge.check.run import check_op
from opforge.check.steps import CheckResult, device_healthy, watching
from opforge.check.values import poisoned_allocations
from opforge.derive import watching_probes
from opforge.opspec import OpSpec
from opforge.project import resolve_target

# Per step: the longest one of the library's own checks is a torch.compile of
from opforge.registry import get_specs

# forward and backward, 10-30 s on two busy cores; a kernel that hangs is
# reported after this long (opforge check --time-limit).
DEFAULT_TIME_LIMIT_S = 300.0
# Before its first step: a child imports torch and loads the operators again, seconds on a busy machine.
STARTUP_LIMIT_S = 300.0
# The child exits with this status after a CUDA error that leaves its context
# unusable: a new child goes on with the rest.
_RESTART = 75

_CHILD = "import sys; sys.path[:0] = sys.argv[1:]; from opforge.check.process import child_main; child_main()"
_TRIAL = "import sys; sys.path[:0] = sys.argv[3:]; from opforge.check.process import trial_main; trial_main(sys.argv[1], int(sys.argv[2]))"


@dataclass
class Loads:
    """What a child process loads to find the operators this one checks."""

    own_library: bool = False  # opforge's op library (opforge.load)
    wait_fast: bool = False  # with its eager fast path attached first, as here
    targets: Sequence[str] = field(default_factory=list)  # spec files and package folders (opforge.project.resolve_target)


@dataclass
class _Job:
    loads: Loads
    work: list[tuple[str, list[str]]]  # (qualified name, checks) in order
    device: str
    seed: int
    seeds: int
    reference_device: str | None
    fd: int


# --- the child ---


def _send(fd: int, message: tuple[Any, ...]) -> None:
    data = pickle.dumps(message)
    view = memoryview(struct.pack("<I", len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def child_main() -> None:
    """The child's side: reads the job from stdin, loads what it names, runs
    the checks and writes each step and result to the pipe."""
    job: _Job = pickle.load(sys.stdin.buffer)
    fd = job.fd
    if job.loads.own_library:
        opforge.load(wait_fast=job.loads.wait_fast)
    for target in job.loads.targets:
        resolve_target(target)
    # What the first steps would import (inductor, through the deterministic mode that poisons
    # allocations: 3-5 s on two cores; opcheck's tests): before the time limit starts counting.
    # lazy: import time (torch._dynamo 1.6 s, torch.testing._internal.optests 1.55 s): the child's, before its time limit counts
    import torch._dynamo
    import torch.testing._internal.optests

    with poisoned_allocations():
        pass
    _send(fd, ("ready",))
    device = torch.device(job.device)

    def on_result(qualname: str, result: CheckResult) -> None:
        _send(fd, ("result", qualname, result))
        if result.status == "fail" and not device_healthy(device):
            # A kernel that faulted leaves this process's CUDA context unusable: every later check would fail for it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(_RESTART)

    with watching(lambda op, check, label: _send(fd, ("step", op, check, label))):
        for qualname, checks in job.work:
            try:
                (spec,) = get_specs([qualname])
            except KeyError:
                _send(fd, ("missing", qualname))
                continue
            check_op(spec, device, job.seed, checks, job.seeds, job.reference_device, on_result=lambda r, q=qualname: on_result(q, r))
    _send(fd, ("done",))


def trial_main(target: str, fd: int) -> None:
    """A trial load's side: loads ``target``, writing each operator's name to the
    pipe before ``opforge.spec`` first calls it. A load that raises exits 1
    quietly: the load in opforge check's own process says why."""
    _send(fd, ("ready",))
    with watching_probes(lambda name: _send(fd, ("step", name))):
        try:
            resolve_target(target)
        except BaseException:  # noqa: BLE001 - said by the load that follows, in opforge check's process
            os._exit(1)
    _send(fd, ("done",))
    sys.stdout.flush()
    os._exit(0)


# --- this process's side ---


def _reason(returncode: int) -> tuple[str, str]:
    """(a word for the table, a sentence) for a child that ended with ``returncode``."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"signal {-returncode}", f"killed the process with signal {-returncode}"
        what = signal.strsignal(sig) or ""
        return sig.name, f"killed the process with {sig.name}{f' ({what})' if what else ''}"
    return f"exit {returncode}", f"ended the process with exit status {returncode}"


class _Child:
    """One child process and the frames it writes to its pipe: the checks' child
    (``job``), or a trial load of spec file ``trial`` writing to ``fd``, its
    output to ``stderr``."""

    def __init__(self, job: _Job | None, *, trial: str = "", fd: int = -1, stderr: Any = None) -> None:
        env = {**os.environ, "OPFORGE_NO_AUTOLOAD": "1"}
        if job is None or not job.loads.wait_fast:
            # Without the eager fast path here (not built, or its build still running), as without it
            # there: the child neither starts a build of its own nor checks other autograd kernels.
            env["OPFORGE_FAST"] = "0"
        argv = [sys.executable, "-c", _CHILD, *sys.path] if job is not None else [sys.executable, "-c", _TRIAL, trial, str(fd), *sys.path]
        # Its own process group (popen): killed whole, compile workers included.
        self.proc = popen(
            argv,
            stdin=subprocess.PIPE if job is not None else subprocess.DEVNULL,
            stdout=stderr,
            stderr=stderr,
            pass_fds=(job.fd if job is not None else fd,),
            env=env,
        )
        if job is not None:
            assert self.proc.stdin is not None
            try:
                pickle.dump(job, self.proc.stdin)
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        self.buffer = b""

    def next_message(self, fd: int, timeout: float) -> tuple[Any, ...] | str:
        """The next frame; "eof" when the child closed the pipe (it ended), "timeout" when it wrote nothing for ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            if len(self.buffer) >= 4:
                (size,) = struct.unpack("<I", self.buffer[:4])
                if len(self.buffer) >= 4 + size:
                    frame, self.buffer = self.buffer[4 : 4 + size], self.buffer[4 + size :]
                    return pickle.loads(frame)
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            readable, _, _ = select.select([fd], [], [], left)
            if not readable:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return "eof"
            self.buffer += chunk

    def kill(self) -> None:
        """The child and every process it started."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.proc.kill()
        self.proc.wait()


def check_workers(n_specs: int) -> int:
    """How many child processes share the operators: OPFORGE_CHECK_WORKERS, else one per four
    cores, at most four (each child's torch.compile runs compile workers of its own)."""
    raw = os.environ.get("OPFORGE_CHECK_WORKERS", "")
    if raw.strip():
        try:
            wanted = int(raw)
        except ValueError:
            raise ValueError(f"OPFORGE_CHECK_WORKERS must be a whole number of processes, got {raw!r}") from None
        if wanted < 1:
            raise ValueError(f"OPFORGE_CHECK_WORKERS must be at least 1, got {wanted}")
    else:
        wanted = min(4, max(1, (os.cpu_count() or 1) // 4))
    return max(1, min(wanted, n_specs))


@dataclass
class LoadCrash:
    """A spec file whose load ended or hung its process: where, and why in words."""

    target: str
    operator: str  # the operator whose first call it was in; "" outside one (the file's own code)
    word: str  # for the table: SIGSEGV, exit 134, time limit
    why: str


def trial_load(target: str, time_limit: float = DEFAULT_TIME_LIMIT_S) -> LoadCrash | None:
    """Loads spec file ``target`` in a child process (its own process group)
    first: None when it loads, or raises (the load in this process then says
    why); else what killed it or kept it running past ``time_limit`` s (it is
    then killed), with the operator whose first call it was in."""
    read_fd, write_fd = os.pipe()
    with tempfile.TemporaryFile() as output:
        try:
            child = _Child(None, trial=target, fd=write_fd, stderr=output)
        finally:
            os.close(write_fd)
        operator = ""
        ready = timed_out = False
        try:
            while True:
                message = child.next_message(read_fd, time_limit if ready else max(time_limit, STARTUP_LIMIT_S))
                if message == "timeout":
                    timed_out = True
                    child.kill()
                    break
                if message == "eof" or message[0] == "done":
                    break
                if message[0] == "ready":
                    ready = True
                elif message[0] == "step":
                    operator = message[1]
        except BaseException:
            child.kill()  # interrupted: no child outlives this process
            raise
        finally:
            os.close(read_fd)
        returncode = child.proc.wait()
        if not ready and not timed_out:
            return None  # it could not start: the load here goes on as without it
        if timed_out:
            word, why = "time limit", f"was still running after {time_limit:g} s (--time-limit): killed"
        elif returncode in (0, 1):
            return None
        else:
            word, why = _reason(returncode)
            output.seek(0)
            said = [ln.strip() for ln in output.read().decode(errors="replace").splitlines() if ln.strip()]
            if said:
                why += f" (its last words: {said[-1][:200]})"
    if operator:
        why = f"{operator}: its first call (opforge.spec calls the operator once, on 3x5 inputs, as the file loads) {why}"
    else:
        why = f"loading it {why}"
    return LoadCrash(target, operator, word, why)


def run_checks(
    specs: Sequence[OpSpec],
    device: torch.device,
    seed: int,
    checks: Sequence[str],
    seeds: int = 1,
    reference_device: torch.device | str | None = None,
    *,
    loads: Loads,
    time_limit: float = DEFAULT_TIME_LIMIT_S,
    on_op: Callable[[OpSpec, list[CheckResult]], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    workers: int | None = None,
) -> dict[str, list[CheckResult]]:
    """``check.check_op`` of every spec, in child processes (this module's
    docstring says how): ``workers`` of them (default ``check_workers``), each
    with every ``workers``-th operator; the results by qualified name, in the
    specs' order. ``on_op`` is called as each operator's checks end; ``on_note``
    with what the report should say besides (a child that could not start: the
    checks then run in this process, after the children are done)."""
    by_name = {s.qualname: s for s in specs}
    n = check_workers(len(by_name)) if workers is None else max(1, min(workers, len(by_name)))
    lock = threading.Lock()

    def locked(fn: Callable[..., None] | None) -> Callable[..., None] | None:
        if fn is None:
            return None

        def call(*args: Any) -> None:
            with lock:
                fn(*args)

        return call

    names = list(by_name)
    parts = [[by_name[q] for q in names[k::n]] for k in range(n)]
    args = (device, seed, checks, seeds, reference_device, loads, time_limit, locked(on_op), locked(on_note))
    if n == 1:
        outcomes = [_run_children(parts[0], *args)]
    else:
        pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="opforge-check")
        try:
            outcomes = list(pool.map(lambda part: _run_children(part, *args), parts))
        except BaseException:
            # Interrupted here (Ctrl-C reaches the main thread only): the other threads' children too,
            # each of which leads a process group of its own, out of the terminal's reach.
            end_children()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    results: dict[str, list[CheckResult]] = {q: [] for q in by_name}
    here: list[tuple[str, list[str]]] = []
    for got, left in outcomes:
        for q, rs in got.items():
            results[q] += rs
        here += left
    # Operators no child had, or left when a child could not start: here, one at a time.
    for qualname, left in here:
        for result in check_op(by_name[qualname], device, seed, left, seeds, reference_device):
            results[qualname].append(result)
        if on_op is not None:
            on_op(by_name[qualname], results[qualname])
    return {q: _ordered(results[q], checks) for q in by_name}


def _run_children(
    specs: Sequence[OpSpec],
    device: torch.device,
    seed: int,
    checks: Sequence[str],
    seeds: int,
    reference_device: torch.device | str | None,
    loads: Loads,
    time_limit: float,
    on_op: Callable[[OpSpec, list[CheckResult]], None] | None,
    on_note: Callable[[str], None] | None,
) -> tuple[dict[str, list[CheckResult]], list[tuple[str, list[str]]]]:
    """``specs`` checked in one child process after another (a new one after a crash or a
    hang); the results, and the (operator, checks) left for this process."""
    by_name = {s.qualname: s for s in specs}
    results: dict[str, list[CheckResult]] = {q: [] for q in by_name}
    pending: list[tuple[str, list[str]]] = [(q, list(checks)) for q in by_name]
    here: list[tuple[str, list[str]]] = []  # what runs in this process: operators the child does not have

    def record(qualname: str, result: CheckResult) -> None:
        results[qualname].append(result)
        for k, (q, left) in enumerate(pending):
            if q == qualname:
                if result.check in left:
                    left.remove(result.check)
                if not left:
                    del pending[k]
                    if on_op is not None:
                        on_op(by_name[qualname], results[qualname])
                return

    def fail_step(step: tuple[str, str, str] | None, word: str, why: str) -> None:
        qualname, check, label = step if step is not None else (*_first(pending), "")
        spec = by_name[qualname]
        where = label or f"{spec.name} (before its first step)"
        record(qualname, CheckResult(spec.name, check, "fail", count=1, failures=[f"{where}: {why}"], tag=word, crashed=True))

    while pending:
        read_fd, write_fd = os.pipe()
        job = _Job(loads, [(q, list(c)) for q, c in pending], str(device), seed, seeds,
                   None if reference_device is None else str(reference_device), write_fd)  # fmt: skip
        try:
            child = _Child(job)
        finally:
            os.close(write_fd)
        step: tuple[str, str, str] | None = None
        ready = timed_out = False
        try:
            while True:
                message = child.next_message(read_fd, time_limit if ready else max(time_limit, STARTUP_LIMIT_S))
                if message == "eof":
                    break
                if message == "timeout":
                    timed_out = True
                    child.kill()
                    break
                kind, *rest = message
                if kind == "ready":
                    ready = True
                elif kind == "step":
                    step = (rest[0], rest[1], rest[2])
                elif kind == "result":
                    record(rest[0], rest[1])
                    step = None
                elif kind == "missing":
                    here += [(q, c) for q, c in pending if q == rest[0]]
                    pending[:] = [(q, c) for q, c in pending if q != rest[0]]
        except BaseException:
            child.kill()  # interrupted (Ctrl-C): no child outlives this process
            raise
        finally:
            os.close(read_fd)
        returncode = child.proc.wait()
        if not pending:
            break
        if not ready:
            if on_note is not None:
                why = f"ran past {max(time_limit, STARTUP_LIMIT_S):g} s while starting" if timed_out else _reason(returncode)[1]
                on_note(f"the checks' own process {why}; the rest run in this process, where a crash ends opforge check")
            here += pending
            pending.clear()
        elif timed_out:
            why = f"still running after {time_limit:g} s (--time-limit): killed; the checks went on in a new process"
            fail_step(step, "time limit", why)
        elif returncode != _RESTART:
            word, why = _reason(returncode)
            fail_step(step, word, f"{why} in this step; the checks went on in a new process")
    return results, here


def _first(pending: list[tuple[str, list[str]]]) -> tuple[str, str]:
    qualname, left = pending[0]
    return qualname, left[0]


def _ordered(results: list[CheckResult], checks: Sequence[str]) -> list[CheckResult]:
    """One result per check, in the order asked (a restart may have reported them out of order)."""
    by_check = {r.check: r for r in results}
    return [by_check[c] for c in checks if c in by_check]
