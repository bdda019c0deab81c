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
        self.total = n_units + 1  # at most one compile per translation unit, then the link
        self.n_sources = n_sources
        self._before = 0
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = time.perf_counter()

    def start(self) -> None:
        if not self.quiet:
            self._before = self._steps()  # an incremental build appends to the log
            units = f" in {self.total - 1} compile jobs" if self.total - 1 != self.n_sources else ""
            print(
                f"opforge: building {self.name} ({self.n_sources} sources{units}, unchanged ones reused)...",
                file=sys.stderr,
                flush=True,
            )
            self._thread.start()

    def _steps(self) -> int:
        try:
            lines = (self.objects / ".ninja_log").read_text().splitlines()
        except OSError:
            return 0
        return sum(1 for ln in lines if ln and not ln.startswith("#"))

    def _run(self) -> None:
        last_print = 0.0
        while not self._done.wait(0.5):
            elapsed = time.perf_counter() - self._start
            line = f"opforge: compiling [{self._steps() - self._before}/{self.total}] {elapsed:4.0f} s"
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
