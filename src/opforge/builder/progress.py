"""Build progress on stderr, read from ninja's log of finished steps."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path


class Progress:
    """Prints build progress on stderr from ninja's log of finished steps."""

    def __init__(self, objects: Path, name: str, n_units: int, n_sources: int, *, quiet: bool) -> None:
        self.objects = objects
        self.name = name
        self.total = n_units  # one compile per translation unit; the link after them is not counted
        self.n_sources = n_sources
        self._before = 0  # compiles an earlier build logged: an incremental build appends to the log
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = time.perf_counter()

    def start(self) -> None:
        if not self.quiet:
            self._before = self._compiled()
            units = f" in {self.total} compile jobs" if self.total != self.n_sources else ""
            sources = f"{self.n_sources} source{'s' if self.n_sources != 1 else ''}"
            print(
                f"opforge: building {self.name} ({sources}{units}, unchanged ones reused)...",
                file=sys.stderr,
                flush=True,
            )
            self._thread.start()

    def _compiled(self) -> int:
        """The compile steps (an object file's) ninja's log holds: "start end mtime output hash" a line."""
        try:
            lines = (self.objects / ".ninja_log").read_text().splitlines()
        except OSError:
            return 0
        return sum(1 for ln in lines if not ln.startswith("#") and len(f := ln.split("\t")) > 3 and f[3].endswith(".o"))

    def status(self, elapsed: float) -> str:
        """The progress line: "[k/N]", k of the N translation units compiled (the
        link is not one of them), and the build's name, as the builds of a
        setup.py's extensions run at once (opforge.builder.many)."""
        done = max(0, min(self.total, self._compiled() - self._before))  # ninja may recompact its log
        return f"opforge: compiling {self.name} [{done}/{self.total}] {elapsed:4.0f} s"

    def _run(self) -> None:
        last_print = 0.0
        while not self._done.wait(0.5):
            elapsed = time.perf_counter() - self._start
            line = self.status(elapsed)
            if self.tty:
                print("\r" + line, end="", file=sys.stderr, flush=True)
            elif elapsed - last_print >= 10:
                print(line, file=sys.stderr, flush=True)
                last_print = elapsed

    def stop(self, *, ok: bool, seconds: float = 0.0) -> None:
        if self.quiet:
            return
        self._done.set()
        self._thread.join()
        if self.tty:
            print("\r", end="", file=sys.stderr)
        if ok:
            print(f"opforge: built {self.name} in {seconds:.1f} s", file=sys.stderr, flush=True)


__all__ = ["Progress"]
