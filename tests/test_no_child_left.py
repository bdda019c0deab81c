"""SIGTERM (or SIGHUP, Ctrl-C) to ``opforge build`` or ``opforge check`` leaves
no process of theirs running: a setup.py reader, a check's process in a user's
kernel, and whatever those started, end with the command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .conftest import SRC


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _start(*args: str, cwd: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "OPFORGE_CHECK_IN_PROCESS"}
    env |= {"PYTHONPATH": SRC, "OPFORGE_NO_AUTOLOAD": "1", "OPFORGE_FAST": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "opforge", *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=_as_from_a_terminal,
    )


def _as_from_a_terminal() -> None:
    """SIGHUP and SIGINT as a command started from a terminal has them: under nohup or as a
    shell's background job the suite inherits them ignored, and opforge keeps an ignored signal ignored."""
    for s in (signal.SIGHUP, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL)


def _pids_when_started(marker: Path, command: subprocess.Popen, wait: float = 180) -> list[int]:
    """The pids the user's code wrote to ``marker`` once it runs (the command still running)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if marker.is_file() and (text := marker.read_text()).endswith("\n"):
            return [int(p) for p in text.split()]
        assert command.poll() is None, command.communicate()[0].decode(errors="replace")[-3000:]
        time.sleep(0.2)
    command.kill()
    pytest.fail(f"the user's code did not start within {wait:.0f} s")


def _stop_and_assert_none_left(command: subprocess.Popen, pids: list[int], how: signal.Signals = signal.SIGTERM) -> None:
    assert all(_alive(p) for p in pids), pids
    command.send_signal(how)
    try:
        command.wait(timeout=30)
    except subprocess.TimeoutExpired:
        command.kill()
        pytest.fail(f"opforge did not end within 30 s of {how.name}")
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"still running {10:.0f} s after opforge ended: {left}"


# The user's code, started by opforge: it starts a helper of its own, writes both pids, and never returns.
_FOREVER = """
import os, subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open({marker!r}, "w") as f:
    f.write(f"{{os.getpid()}} {{helper.pid}}\\n")
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_build_stopped_while_setup_py_runs_leaves_no_child(tmp_path, how):
    folder = tmp_path / "sleepy"
    folder.mkdir()
    marker = tmp_path / "pids"
    # It would declare a CppExtension (what makes the folder a setup.py's), had it ever returned.
    (folder / "setup.py").write_text(
        "# setup(ext_modules=[CppExtension('sleepy', ['sleepy.cpp'])])\n" + _FOREVER.format(marker=str(marker))
    )
    (folder / "sleepy.cpp").write_text("int f() { return 1; }\n")
    command = _start("build", str(folder), cwd=tmp_path)
    _stop_and_assert_none_left(command, _pids_when_started(marker, command), how)


def _hanging_spec(folder: Path, marker: Path) -> Path:
    """A spec file whose kernel never returns from a call on anything but opforge.spec's 3x5 probe:
    the file loads, and the checks' own process hangs in it."""
    file = folder / "hang_spec.py"
    kernel = textwrap.indent(_FOREVER.format(marker=str(marker)).strip(), "        ")
    file.write_text(
        "import torch\nimport opforge\n\n"
        'torch.library.define("no_child_left::op", "(Tensor x) -> Tensor")\n\n\n'
        '@torch.library.impl("no_child_left::op", "CPU")\n'
        "def _kernel(x):\n"
        "    if x.numel() != 15:\n"
        f"{kernel}\n"
        "    return x.clone()\n\n\n"
        "SPECS = [opforge.spec(torch.ops.no_child_left.op.default, reference=lambda x: x.clone())]\n"
    )
    return file


def test_check_stopped_while_a_kernel_hangs_leaves_no_child(tmp_path):
    marker = tmp_path / "pids"
    file = _hanging_spec(tmp_path, marker)
    command = _start("check", str(file), "--checks", "reference", cwd=tmp_path)
    _stop_and_assert_none_left(command, _pids_when_started(marker, command))


def test_check_stopped_while_its_spec_file_loads_leaves_no_child(tmp_path):
    marker = tmp_path / "pids"
    file = _hanging_spec(tmp_path, marker)
    file.write_text(file.read_text().replace("x.numel() != 15", "True"))  # the probe's call hangs too
    command = _start("check", str(file), cwd=tmp_path)
    _stop_and_assert_none_left(command, _pids_when_started(marker, command))
