"""Processes that run a user's code for ``opforge build``: bounded in time, and
ended whole, and a freshly built library's first load, done in one of them.

A setup.py that starts a helper which keeps the pipes open would outlive a
plain ``subprocess.run(timeout=...)``: only the direct child is killed, and the
helper is left running. Each child here leads a process group of its own, and a
time limit ends the group.

A library's static initializers (``TORCH_LIBRARY`` blocks among them) run as
it loads; a registration error there (one namespace defined twice, an operator
defined twice, a malformed schema, an initializer that throws) ends the process
with a C++ ``terminate``. ``verify_load`` loads a fresh build in a child first,
so that such an error is a one-line message naming the source, and this process
lives on; a library that loaded once is marked beside it, and not checked again.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opforge.builder.errors import sanitizer_note
from opforge.builder.symbols import undefined_symbol_error

#: A load runs the library's static initializers and imports torch: seconds, a minute on a loaded machine.
LOAD_TIMEOUT_S = 300.0


# prctl(PR_SET_PDEATHSIG, SIGKILL): resolved here, not in the forked child, where loading would be unsafe.
_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _prctl = None
_SIGKILL = int(signal.SIGKILL)

# Every child started by ``popen`` that may still run: ended, group and all, by ``end_children``.
_STARTED: weakref.WeakSet[subprocess.Popen[Any]] = weakref.WeakSet()


def dies_with_parent() -> None:
    """A ``preexec_fn``: the child is sent SIGKILL when the thread that started it
    ends (this process killed outright, by SIGKILL or a crash); Linux only."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)


def popen(cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(cmd, **kwargs)`` for a child that must not outlive
    this process: it leads a process group of its own (ended whole by
    ``kill_group``, and by ``end_children`` when this process is told to stop),
    and is killed when this process dies (``dies_with_parent``)."""
    proc = subprocess.Popen(list(cmd), start_new_session=True, preexec_fn=dies_with_parent, **kwargs)
    _STARTED.add(proc)
    return proc


def end_children() -> None:
    """Kills every process group that ``popen`` started and that still runs:
    what a SIGTERM or a Ctrl-C to the command does before it exits."""
    for proc in list(_STARTED):
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


def run_bounded(cmd: Sequence[str], *, timeout: float | None, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, stdin=DEVNULL, **kwargs)``
    in a process group of its own (``popen``); past ``timeout`` the whole group is killed
    (what the child started included) and ``subprocess.TimeoutExpired`` raised."""
    with popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            # The pipes close once every process of the group is gone.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=10)
            raise subprocess.TimeoutExpired(proc.args, timeout) from None
        except BaseException:
            kill_group(proc)
            raise
        # A helper left running after the child exited keeps its group: end it too.
        kill_group(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=10)


# Run as `python -c _LOAD KIND PATH [NAME]`: torch first, as every user of a torch extension imports it.
_LOAD = """
import sys
import torch
kind, path = sys.argv[1], sys.argv[2]
if kind == "module":
    import importlib.util
    spec = importlib.util.spec_from_file_location(sys.argv[3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
else:
    try:
        torch.ops.load_library(path)
    except OSError as exc:
        # torch says only "Could not load this library"; the loader's reason is the cause.
        sys.exit(f"OSError: {exc.__cause__ or exc}")
"""


def _marker(path: Path) -> Path:
    return path.with_name(f".{path.name}.loads")


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def verified(path: Path) -> bool:
    """Whether this very file (device, inode, size, mtime) loaded once in a child."""
    try:
        return _marker(path).read_text() == _stamp(path)
    except OSError:
        return False


def verify_load(path: Path, *, module: str = "", sources: Sequence[Path] = (), root: Path | None = None) -> str | None:
    """Loads ``path`` in a new process (imports it as ``module`` where given,
    else loads it into torch.ops) unless it loaded there once already: None
    when it loads, else why not, in one line, naming the source of ``sources``
    that made the error where it can be told. The first load of a library
    into this process comes after this; a failure leaves this process as it was."""
    path = Path(path)
    if verified(path):
        return None
    cmd = [sys.executable, "-c", _LOAD, "module" if module else "library", str(path), *([module] if module else [])]
    env = {**os.environ, "OPFORGE_NO_AUTOLOAD": "1"}
    try:
        res = run_bounded(cmd, timeout=LOAD_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return f"loading {path.name} did not finish within {LOAD_TIMEOUT_S:.0f} s (a static initializer that waits or loops?)"
    if res.returncode == 0:
        with contextlib.suppress(OSError):
            tmp = _marker(path).with_name(f"{_marker(path).name}.{os.getpid()}.tmp")
            tmp.write_text(_stamp(path))
            os.replace(tmp, _marker(path))
        return None
    return load_failure(res.stderr, res.returncode, path, sources, root)


# torch's registration errors: where the clash or the bad call came from.
_REGISTERED_AT = re.compile(r"(?:registered|TORCH_LIBRARY\w*)[^\n]*? at (\S+?):(\d+)")
_WHAT = re.compile(r"what\(\):\s*(.*)")
_PY_ERROR = re.compile(r"^(\w+(?:\.\w+)*(?:Error|Exception)): (.*)$")


def load_failure(stderr: str, returncode: int, path: Path, sources: Sequence[Path] = (), root: Path | None = None) -> str:
    """A failed load's output (a C++ ``terminate`` with its backtrace, or a
    Python traceback) as one line: the error's first line, and the source
    among ``sources`` that made it where torch says which file registered."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    message = ""
    quoted = ""
    for i, ln in enumerate(lines):
        if m := _WHAT.search(ln):
            # The message's own further lines (a schema parser's shows the schema), up to torch's trace.
            more = []
            for nxt in lines[i + 1 :]:
                if nxt.startswith(("Exception raised from", "frame #", "<omitting")) or _PY_ERROR.match(nxt):
                    break
                if not re.fullmatch(r"[~^\s]*(<-+ HERE)?", nxt):
                    more.append(nxt)
            message = " ".join([m[1].strip(), *more]).strip()
            if m[1].rstrip().endswith("here:") and more:
                quoted = more[0]
            break
    if not message:
        for ln in reversed(lines):
            if m := _PY_ERROR.match(ln):
                message = m[2].strip()
                break
    if not message:
        if returncode < 0:
            try:
                name = signal.Signals(-returncode).name
            except ValueError:
                name = f"signal {-returncode}"
            message = f"the process was killed by {name}" + (f": {lines[-1]}" if lines else "")
        else:
            message = lines[-1] if lines else f"exit status {returncode}"
    message = re.sub(r"\s*\(Triggered internally at [^)]*\)", "", message)
    if note := sanitizer_note("\n".join(lines)):
        said = "" if "runtime does not come first" in message else f"{message}; "  # the note says it
        return f"loading {path.name} fails: {said}{note}"
    if explained := undefined_symbol_error(path.name, message, (), root=root, sources=sources):
        return f"loading {path.name} fails on an undefined symbol: {str(explained).removeprefix(f'opforge: {path.name}: ')}"
    text = "\n".join(lines)
    where = _source_of(text, path, sources, root, quoted)
    return f"loading {path.name} fails: {message}" + (f" ({where})" if where else "")


def _source_of(text: str, path: Path, sources: Sequence[Path], root: Path | None, quoted: str = "") -> str:
    """The user's source that torch names as the registration's place, as
    "made by FILE:LINE"; else the one whose code holds ``quoted`` (the schema a
    parser's error shows), else the only source."""

    def shown(p: Path) -> str:
        return p.relative_to(root).as_posix() if root is not None and p.is_relative_to(root) else str(p)

    by_name = {s.name: s for s in sources}
    found: list[str] = []
    for file, line in _REGISTERED_AT.findall(text):
        source = next((s for s in sources if str(s) == file), None) or by_name.get(Path(file).name)
        if source is not None and (entry := f"{shown(source)}:{line}") not in found:
            found.append(entry)
    if found:
        return "made by " + ", ".join(found)
    if quoted:
        for source in sources:
            try:
                for n, code in enumerate(source.read_text(errors="replace").splitlines(), 1):
                    if f'"{quoted}' in code:
                        return f"made by {shown(source)}:{n}"
            except OSError:
                continue
    if len(sources) == 1:
        return f"made by {shown(sources[0])}"
    return ""


__all__ = [
    "LOAD_TIMEOUT_S",
    "dies_with_parent",
    "end_children",
    "kill_group",
    "load_failure",
    "popen",
    "run_bounded",
    "verified",
    "verify_load",
]
