"""The field trial: public extension packages, each built by its own install and by `opforge build`.

For every package of ``packages.toml`` (source distributions on the package index, never
committed) it runs, each step in a process group of its own that is killed whole at its time
limit, and gives a verdict (pass / fail / n/a / skip) with seconds and the first error line:

  own_install   the project's own documented install, ``pip install --no-deps
                --no-build-isolation --target T .`` on a copy of the sdist (the yardstick),
                and the tests the sdist ships against it
  build         ``opforge build ROOT`` bare, on a fresh copy
  import        its modules imported from that copy, torch first, as its users import them
  own_tests     the tests the sdist ships, with pytest, against opforge's build
  check, bench  ``opforge check SPEC`` and ``opforge bench SPEC`` with the spec file beside the list

Rows go to ``benchmarks/results/field_<device>_<date>.json`` (written after each package, rows
of packages run again replaced); ``--table FILE`` prints a file's table, ``--docs`` rewrites the
tables in docs/field.md from the newest result of each device.

    python benchmarks/field/run.py --device cpu --jobs 2 [NAME ...]
    python benchmarks/field/run.py --sdists DIR --device cuda     # sdists fetched elsewhere, no index
    python benchmarks/field/run.py --opforge-src OTHER/src        # another tree's opforge

Opt-in: it needs the package index (or ``--sdists``) and hours on two cores; not part of CI.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RESULTS = REPO / "benchmarks" / "results"
DOCS = REPO / "docs" / "field.md"
CACHE = Path(os.environ.get("OPFORGE_FIELD_CACHE", Path.home() / ".cache" / "opforge-field"))

# own_tests_own_install: the same tests against the project's own install, so that a test that fails
# with opforge's build can be told from one that fails anyway.
STEPS = ("own_install", "own_tests_own_install", "build", "import", "own_tests", "check", "bench")
VERDICTS = ("pass", "fail", "n/a", "skip")
BACKENDS = ("cpu", "cuda")
LABELS = {
    "own_install": "own install",
    "own_tests_own_install": "own tests, own install",
    "build": "opforge build",
    "import": "import",
    "own_tests": "own tests, opforge's build",
    "check": "check",
    "bench": "bench",
}
# Per-step limits in seconds (--limit STEP=SECONDS overrides).
LIMITS = {
    "download": 600,
    "own_install": 900,
    "build": 900,
    "import": 300,
    "own_tests": 900,
    "own_tests_own_install": 900,
    "check": 900,
    "bench": 600,
}
_KEYS = {"name", "version", "layout", "backends", "modules", "import_path", "tests", "spec", "env", "requires", "note"}


class ListError(ValueError):
    """packages.toml is not what the harness can run."""


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    layout: str
    backends: tuple[str, ...]
    modules: tuple[str, ...]
    import_path: str = "."
    tests: tuple[str, ...] = ()
    spec: str = ""
    env: dict[str, str] = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    note: str = ""


@dataclass
class Step:
    verdict: str
    seconds: float = 0.0
    first_error: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}, got {self.verdict!r}")

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "seconds": round(self.seconds, 1), "first_error": self.first_error}


def parse_list(text: str, where: str = "packages.toml") -> list[Package]:
    """The packages of a list, each checked: a bad entry is an error naming it and the value."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ListError(f"{where}: not TOML: {e}") from None
    entries = data.get("package")
    if not isinstance(entries, list) or not entries:
        raise ListError(f"{where}: no [[package]] entries")
    out: list[Package] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        label = f"{where}: package {entry.get('name', f'#{i + 1}')!s}"
        unknown = sorted(set(entry) - _KEYS)
        if unknown:
            raise ListError(f"{label}: unknown key {', '.join(unknown)}; the keys are {', '.join(sorted(_KEYS))}")
        for key in ("name", "version", "layout"):
            if not isinstance(entry.get(key), str) or not entry[key].strip():
                raise ListError(f"{label}: {key} must be a non-empty string, got {entry.get(key)!r}")
        if not re.fullmatch(r"[0-9][0-9A-Za-z.+!_-]*", entry["version"]):
            raise ListError(f"{label}: version must be a pinned version (2.1.2), got {entry['version']!r}")
        if entry["name"] in seen:
            raise ListError(f"{label}: listed twice")
        seen.add(entry["name"])
        backends = entry.get("backends", [])
        if not backends or any(b not in BACKENDS for b in backends):
            raise ListError(f"{label}: backends must be a list of {' and '.join(BACKENDS)}, got {backends!r}")
        modules = entry.get("modules", [])
        if not modules or not all(isinstance(m, str) and m for m in modules):
            raise ListError(f"{label}: modules must name the modules its users import, got {modules!r}")
        tests = entry.get("tests", [])
        if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
            raise ListError(f"{label}: tests must be a list of pytest arguments, got {tests!r}")
        env = entry.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise ListError(f"{label}: env must be a table of strings, got {env!r}")
        out.append(
            Package(
                name=entry["name"],
                version=entry["version"],
                layout=entry["layout"],
                backends=tuple(backends),
                modules=tuple(modules),
                import_path=entry.get("import_path", "."),
                tests=tuple(tests),
                spec=entry.get("spec", ""),
                env=dict(env),
                requires=tuple(entry.get("requires", ())),
                note=entry.get("note", ""),
            )
        )
    for p in out:
        missing = [r for r in p.requires if r not in seen]
        if missing:
            raise ListError(f"{where}: package {p.name}: requires {', '.join(missing)}, which the list does not hold")
    return out


# A line that says what went wrong, most telling first; else the last line of the output.
_OPFORGE = re.compile(r"^opforge( \w+)?: .*(fail|error|cannot|can't|not |refus|needs|missing|nothing|no ).*", re.IGNORECASE)
_EXCEPTION = re.compile(r"^\w*(Error|Exception|Interrupt)\b(: .*)?$")
_ERROR_PATTERNS = [
    re.compile(r"^\S+:\d+(:\d+)?: (fatal )?error: .*"),  # a compiler's, before opforge's "building x failed"
    _OPFORGE,
    re.compile(r"^x [\w ]+: .*"),  # a failed check of `opforge check`
    re.compile(r"^bench \S+ .*: refused: .*"),  # an operator `opforge bench` will not time
    re.compile(r"^E\s+\w*(Error|Exception)\b.*"),  # pytest's
    _EXCEPTION,
    re.compile(r"^error: (?!subprocess-exited-with-error|metadata-generation-failed).*", re.IGNORECASE),
    re.compile(r"^(FAILED|ERROR) .*"),
]


def first_error(output: str, limit: int = 300) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for pattern in _ERROR_PATTERNS:
        for i, line in enumerate(lines):
            if not pattern.match(line):
                continue
            if pattern is _EXCEPTION or line.endswith(":"):
                # A traceback's last exception is its cause; a line ending in ":" introduces one.
                after = [x for x in lines[i + 1 :] if _EXCEPTION.match(x)]
                if pattern is _EXCEPTION:
                    line = after[-1] if after else line
                elif after:
                    line = f"{line} {after[-1]}"
            return _clip(line, limit)
    return _clip(lines[-1], limit) if lines else ""


def _clip(text: str, limit: int) -> str:
    # The start says where, the end says what: keep both.
    if len(text) <= limit:
        return text
    head = limit // 3
    return text[:head] + " ... " + text[len(text) - (limit - head - 5) :]


@dataclass
class Ran:
    rc: int | None  # None: killed at the time limit
    seconds: float
    output: str


def run_limited(cmd: list[str], *, cwd: Path, env: dict[str, str], limit: float, log: Path | None = None) -> Ran:
    """``cmd`` in a session (process group) of its own; at ``limit`` seconds the whole group is killed."""
    start = time.monotonic()
    # The output goes to a file, not a pipe: a step that prints more than a pipe holds never blocks.
    sink = open(log, "w+b") if log else tempfile.TemporaryFile()  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        rc: int | None = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        # Whatever the step started (compilers, pytest workers) goes with it.
        kill_session(proc.pid)
        proc.wait()
    seconds = time.monotonic() - start
    sink.seek(0)
    text = sink.read().decode("utf-8", "replace")
    sink.close()
    return Ran(rc, seconds, text)


def kill_session(sid: int) -> None:
    """Every process of session ``sid``: its own process group, and the groups ninja gives each
    compile command (``killpg`` of the step's group alone would leave the compilers running)."""
    for _ in range(5):  # a process may fork while the others are being killed
        found = [pid for pid in _pids() if _session(pid) == sid]
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _session(pid: int) -> int | None:
    try:
        # /proc/PID/stat: "pid (comm) state ppid pgrp session ...", comm may hold spaces and parentheses.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[3]) if fields[0] != "Z" else None


def verdict_of(ran: Ran, limit: float, *, when_fails: str = "fail") -> Step:
    """pass for exit 0; a kill at the limit and any other exit are ``when_fails`` with the first error."""
    if ran.rc is None:
        return Step(when_fails, ran.seconds, f"time limit ({limit:.0f} s) reached: killed; last line: {first_error(ran.output)}")
    if ran.rc == 0:
        return Step("pass", ran.seconds)
    if ran.rc < 0:
        return Step(when_fails, ran.seconds, f"killed by signal {-ran.rc}; {first_error(ran.output)}")
    return Step(when_fails, ran.seconds, first_error(ran.output) or f"exit {ran.rc}")


def following(build: Step, step: str) -> Step | None:
    """The verdict a step gets without running, where the build decides it."""
    if build.verdict != "pass":
        return Step("n/a", 0.0, "build failed" if build.verdict == "fail" else f"build {build.verdict}")
    return None


# -- fetching --------------------------------------------------------------------------------------


def _sdist_names(p: Package) -> list[str]:
    stems = {p.name, p.name.replace("-", "_"), p.name.lower(), p.name.lower().replace("-", "_")}
    return [f"{s}-{p.version}{ext}" for s in sorted(stems) for ext in (".tar.gz", ".zip")]


def find_sdist(p: Package, folder: Path) -> Path | None:
    for name in _sdist_names(p):
        if (folder / name).is_file():
            return folder / name
    return None


def fetch_sdist(p: Package, folder: Path, python: str, limit: float) -> Path:
    """The sdist, downloaded once into ``folder`` by pip; where pip cannot (its metadata step runs the
    setup.py, which for a CUDA-only package stops without CUDA), from the index's own listing."""
    found = find_sdist(p, folder)
    if found:
        return found
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
           f"{p.name}=={p.version}", "-d", str(folder)]  # fmt: skip
    ran = run_limited(cmd, cwd=folder, env=dict(os.environ), limit=limit)
    found = find_sdist(p, folder)
    if found:
        return found
    index = os.environ.get("OPFORGE_FIELD_INDEX", "https://pypi.org/simple")
    req = urllib.request.Request(f"{index}/{p.name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
        entry = next(f for f in files if f["filename"] in _sdist_names(p))
        data = urllib.request.urlopen(entry["url"], timeout=limit).read()
    except (OSError, StopIteration, KeyError, ValueError) as e:
        raise RuntimeError(f"{p.name}=={p.version}: no sdist: pip said {first_error(ran.output)!r}; the index: {e!r}") from None
    if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        raise RuntimeError(f"{p.name}=={p.version}: {entry['filename']} does not match the index's sha256")
    (folder / entry["filename"]).write_bytes(data)
    return folder / entry["filename"]


def unpack(sdist: Path, into: Path) -> Path:
    """The sdist's root folder, unpacked afresh under ``into``."""
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    if sdist.name.endswith(".zip"):
        with zipfile.ZipFile(sdist) as z:
            z.extractall(into)
    else:
        with tarfile.open(sdist) as t:
            t.extractall(into, filter="data")
    roots = [d for d in into.iterdir() if d.is_dir()]
    return roots[0] if len(roots) == 1 else into


# -- the steps -------------------------------------------------------------------------------------


@dataclass
class Setup:
    device: str
    python: str
    opforge_src: Path | None
    jobs: int
    work: Path
    sdists: Path
    limits: dict[str, float]
    keep_cache: bool = False


def _env(s: Setup, p: Package, pythonpath: list[Path]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(p.env)
    env["MAX_JOBS"] = str(s.jobs)
    env["OPFORGE_CACHE_DIR"] = str(s.work / "opforge-cache")
    paths = [str(x) for x in pythonpath]
    if s.opforge_src:
        paths.append(str(s.opforge_src))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if s.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _import_code(modules: tuple[str, ...]) -> str:
    return "import torch\n" + "".join(f"import {m}\n" for m in modules) + "print('imported', " + repr(", ".join(modules)) + ")\n"


def run_package(p: Package, s: Setup, built: dict[str, Path], log_dir: Path) -> dict[str, Any]:
    """One row of the table."""
    row: dict[str, Any] = {"name": p.name, "version": p.version, "layout": p.layout, "backends": list(p.backends)}
    if p.note:
        row["note"] = p.note
    log_dir.mkdir(parents=True, exist_ok=True)

    def limited(step: str, cmd: list[str], cwd: Path, env: dict[str, str]) -> Ran:
        print(f"  {p.name}: {step}: {' '.join(cmd)}", flush=True)
        return run_limited(cmd, cwd=cwd, env=env, limit=s.limits[step], log=log_dir / f"{step}.log")

    def own_tests(flags: list[str], cwd: Path, env: dict[str, str], gate: Step | None, step: str) -> Step:
        if not p.tests:
            return Step("n/a", 0.0, "the sdist ships no tests")
        if gate is not None:
            return gate
        ran = limited(step, [s.python, *flags, "-m", "pytest", "-q", "-p", "no:cacheprovider", *p.tests], cwd, env)
        if ran.rc == 5:
            return Step("n/a", ran.seconds, f"no tests collected for {s.device}: {_pytest_summary(ran.output)}")
        verdict = verdict_of(ran, s.limits[step])
        if ran.rc is not None:  # the counts say more than the first failure
            verdict.first_error = "; ".join(x for x in (_pytest_summary(ran.output), verdict.first_error) if x)
        return verdict

    try:
        sdist = fetch_sdist(p, s.sdists, s.python, s.limits["download"])
    except RuntimeError as e:
        for step in STEPS:
            row[step] = Step("skip", 0.0, str(e)).as_dict()
        return row
    here_cannot = s.device not in p.backends
    deps = [built[r] for r in p.requires if r in built]

    # 1. the project's own install, the yardstick
    own = unpack(sdist, s.work / "own" / p.name)
    target = s.work / "own-target" / p.name
    shutil.rmtree(target, ignore_errors=True)
    cmd = [s.python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--target", str(target), "."]
    ran = limited("own_install", cmd, own, _env(s, p, deps))
    own_install = verdict_of(ran, s.limits["own_install"], when_fails="n/a" if here_cannot else "fail")
    if here_cannot and own_install.verdict == "n/a":
        own_install.first_error = f"{'/'.join(p.backends)} only, this machine: {s.device}; {own_install.first_error}"
    row["own_install"] = own_install.as_dict()
    gate = None if own_install.verdict == "pass" else Step("n/a", 0.0, "own install failed")
    # -P: the sdist's own folder (sources without the built library) is not put before the install.
    row["own_tests_own_install"] = own_tests(["-P"], own, _env(s, p, [target, *deps]), gate, "own_tests_own_install").as_dict()

    # 2. opforge build, bare, on a fresh copy
    root = unpack(sdist, s.work / "opforge" / p.name)
    ran = limited("build", [s.python, "-m", "opforge", "build", str(root)], root, _env(s, p, deps))
    build = verdict_of(ran, s.limits["build"])
    row["build"] = build.as_dict()
    import_root = (root / p.import_path).resolve()
    if build.verdict == "pass":
        built[p.name] = import_root

    # 3. import, as its users import it
    env = _env(s, p, [import_root, *deps])
    step = following(build, "import")
    if step is None:
        # From a folder of its own, so that the sdist's root is on sys.path only through PYTHONPATH.
        ran = limited("import", [s.python, "-c", _import_code(p.modules)], log_dir, env)
        step = verdict_of(ran, s.limits["import"])
    row["import"] = step.as_dict()
    imported = step.verdict == "pass"

    # 4. its own tests, against opforge's build
    gate = following(build, "own_tests") or (None if imported else Step("n/a", 0.0, "import failed"))
    row["own_tests"] = own_tests([], root, env, gate, "own_tests").as_dict()

    # 5, 6. opforge check and bench with the spec file
    for name, extra in (("check", []), ("bench", ["--no-compile", "--budget", "0.2"])):
        if not p.spec:
            row[name] = Step("n/a", 0.0, "no spec: it exposes no operator in torch.ops to name").as_dict()
            continue
        step = following(build, name) or (None if imported else Step("n/a", 0.0, "import failed"))
        if step is None:
            cmd = [s.python, "-m", "opforge", name, str(HERE / p.spec), "--device", s.device, *extra]
            step = verdict_of(limited(name, cmd, root, env), s.limits[name])
        row[name] = step.as_dict()
    return row


def _pytest_summary(output: str) -> str:
    lines = [line.strip(" =") for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    return lines[-1] if lines else ""


# -- results and the table -------------------------------------------------------------------------


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` with the rows of the packages in ``new`` replaced (kept in the list's order)."""
    names = {r["name"] for r in new}
    return [r for r in old if r["name"] not in names] + new


def totals(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out = {step: dict.fromkeys(VERDICTS, 0) for step in STEPS}
    for r in rows:
        for step in STEPS:
            if step in r:
                out[step][r[step]["verdict"]] += 1
    return out


def _cell(step: dict[str, Any]) -> str:
    v = step["verdict"]
    if v in ("pass", "fail") and step.get("seconds"):
        return f"{v} {step['seconds']:.0f} s"
    return v


def render_table(result: dict[str, Any]) -> str:
    """The Markdown table of one results file, its totals and each failure's first error."""
    rows = result["rows"]
    lines = [
        f"{len(rows)} packages, {result['device']} ({result.get('machine', '')}), torch {result.get('torch', '?')}, "
        f"{result.get('date', '?')}, MAX_JOBS={result.get('jobs', '?')}:",
        "",
        "| package | layout | " + " | ".join(LABELS[step] for step in STEPS) + " |",
        "| --- | --- |" + " --- |" * len(STEPS),
    ]
    for r in rows:
        cells = [f"{r['name']} {r['version']}", r["layout"].replace("|", "/")] + [_cell(r[s]) for s in STEPS]
        lines.append("| " + " | ".join(cells) + " |")
    t = totals(rows)
    lines.append("| **totals** | | " + " | ".join(", ".join(f"{n} {v}" for v, n in t[s].items() if n) for s in STEPS) + " |")
    notes = []
    for r in rows:
        for step in STEPS:
            cell = r[step]
            if cell["verdict"] in ("fail", "n/a") and cell["first_error"] and not cell["first_error"].startswith(_NOT_RUN):
                notes.append(f"- {r['name']}, {LABELS[step]} ({r[step]['verdict']}): `{_md(r[step]['first_error'])}`")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return text.replace("`", "'").replace("|", "/")


def write_docs(results: list[Path], docs: Path = DOCS) -> None:
    """Each device's table between its markers in docs/field.md, from its newest results file."""
    text = docs.read_text()
    newest: dict[str, Path] = {}
    for path in sorted(results):
        m = re.fullmatch(r"field_(\w+)_\d{4}-\d{2}-\d{2}\.json", path.name)
        if m:
            newest[m.group(1)] = path
    for device, path in newest.items():
        begin, end = f"<!-- field-table:{device} -->", f"<!-- /field-table:{device} -->"
        if begin not in text or end not in text:
            raise SystemExit(f"{docs}: no {begin} ... {end} markers for {path.name}")
        table = f"From `benchmarks/results/{path.name}`.\n\n" + render_table(json.loads(path.read_text()))
        head, rest = text.split(begin, 1)
        text = head + begin + "\n" + table + end + rest.split(end, 1)[1]
    docs.write_text(text)


# Verdicts given without running the step: nothing in a log to read again.
_NOT_RUN = ("build failed", "build skip", "import failed", "own install failed", "the sdist ships no tests", "no spec:")


# What the harness itself puts before a step's first error.
_KEPT = re.compile(r"^(time limit \(\d+ s\) reached: killed; last line: |killed by signal \d+; |[\w/]+ only, this machine: \w+; "
                   r"|no tests collected for \w+: [^;]*$|[^;]*\d+ (passed|failed|error)[^;]*; )")  # fmt: skip


def rescore(result: dict[str, Any], logs: Path) -> int:
    """Each failed step's first error read again from its log (``logs/<package>/<step>.log``), by the
    rules of this version of the harness; what a message says before its last "; " (a time limit, the
    backends, pytest's counts) is kept. Returns how many changed."""
    changed = 0
    for row in result["rows"]:
        for step in STEPS:
            cell, log = row[step], logs / row["name"] / f"{step}.log"
            if cell["verdict"] not in ("fail", "n/a") or cell["first_error"].startswith(_NOT_RUN) or not log.is_file():
                continue
            kept = _KEPT.match(cell["first_error"])
            new = (kept.group(0) if kept else "") + first_error(log.read_text(errors="replace"))
            changed += new != cell["first_error"]
            cell["first_error"] = new
    return changed


def _machine(device: str) -> str:
    if device == "cuda":
        try:
            import torch

            return torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001 (a name for the table only)
            return "cuda"
    return f"{os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="packages of the list to run (default: all)")
    ap.add_argument("--list", type=Path, default=HERE / "packages.toml")
    ap.add_argument("--device", choices=BACKENDS, default="cpu")
    ap.add_argument("--jobs", type=int, default=2, help="MAX_JOBS for every build (default 2)")
    ap.add_argument("--sdists", type=Path, default=CACHE / "sdists", help="where sdists are kept or were put beforehand")
    ap.add_argument("--work", type=Path, default=None, help="where copies, installs and logs go (default: the cache)")
    ap.add_argument("--opforge-src", type=Path, default=None, help="the src/ folder whose opforge to run (default: this tree's)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS", help="a step's time limit")
    ap.add_argument("--out", type=Path, default=None, help="the results file (default results/field_<device>_<date>.json)")
    ap.add_argument("--download-only", action="store_true", help="fetch the sdists into --sdists and stop")
    ap.add_argument("--keep-cache", action="store_true", help="keep opforge's build cache of an earlier run")
    ap.add_argument("--table", type=Path, default=None, help="print the table of a results file and stop")
    ap.add_argument("--rescore", type=Path, default=None, metavar="RESULTS",
                    help="read each failed step's first error again from the logs under --work, into RESULTS, and stop")  # fmt: skip
    ap.add_argument("--docs", action="store_true", help="rewrite docs/field.md's tables from the newest results and stop")
    args = ap.parse_args(argv)

    if args.table:
        print(render_table(json.loads(args.table.read_text())), end="")
        return 0
    if args.rescore:
        result = json.loads(args.rescore.read_text())
        n = rescore(result, (args.work or CACHE / "work" / result["device"]) / "logs")
        args.rescore.write_text(json.dumps(result, indent=1) + "\n")
        print(f"{args.rescore}: {n} first errors read again")
        return 0
    if args.docs:
        write_docs(list(RESULTS.glob("field_*.json")))
        return 0
    limits = dict(LIMITS)
    for item in args.limit:
        step, _, value = item.partition("=")
        if step not in limits or not value.replace(".", "", 1).isdigit():
            ap.error(f"--limit {item!r}: want STEP=SECONDS, STEP one of {', '.join(limits)}")
        limits[step] = float(value)
    try:
        packages = parse_list(args.list.read_text(), str(args.list))
    except ListError as e:
        ap.error(str(e))
    unknown = [n for n in args.names if n not in {p.name for p in packages}]
    if unknown:
        ap.error(f"not in {args.list.name}: {', '.join(unknown)}; it lists {', '.join(p.name for p in packages)}")
    chosen = [p for p in packages if not args.names or p.name in args.names or p.name in _required(packages, args.names)]
    if args.download_only:
        for p in chosen:
            print(p.name, fetch_sdist(p, args.sdists, args.python, limits["download"]))
        return 0

    # A stopped run stops its step too: SystemExit unwinds through run_limited, which kills the step's group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    opforge_src = (args.opforge_src or REPO / "src").resolve()
    work = (args.work or CACHE / "work" / args.device).resolve()
    if not args.keep_cache:
        shutil.rmtree(work / "opforge-cache", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    s = Setup(args.device, args.python, opforge_src, args.jobs, work, args.sdists.resolve(), limits)
    date = datetime.date.today().isoformat()
    out = args.out or RESULTS / f"field_{args.device}_{date}.json"
    torch_version = subprocess.run([args.python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                   text=True).stdout.strip()  # fmt: skip
    commit = subprocess.run(["git", "-C", str(opforge_src), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    # opforge's own op library, which every `opforge` command loads, is built into the run's cache
    # first, untimed: a package's build time is its own.
    print("opforge's op library, into the run's cache (untimed)", flush=True)
    warm = run_limited([args.python, "-m", "opforge", "build"], cwd=work, env=_env(s, Package("", "", "", ("cpu",), ("",)), []),
                       limit=limits["build"])  # fmt: skip
    if warm.rc != 0:
        raise SystemExit(f"opforge's own op library does not build from {opforge_src}: {first_error(warm.output)}")
    old = json.loads(out.read_text())["rows"] if out.exists() else []
    built: dict[str, Path] = {}
    rows: list[dict[str, Any]] = []
    for p in chosen:
        print(f"{p.name} {p.version}", flush=True)
        row = run_package(p, s, built, work / "logs" / p.name)
        print("  " + ", ".join(f"{k} {row[k]['verdict']}" for k in STEPS), flush=True)
        rows.append(row)
        order = {q.name: i for i, q in enumerate(packages)}
        merged = sorted(merge_rows(old, rows), key=lambda r: order.get(r["name"], len(order)))
        result = {"device": args.device, "machine": _machine(args.device), "torch": torch_version, "date": date,
                  "jobs": args.jobs, "opforge_commit": commit, "limits": limits, "rows": merged}  # fmt: skip
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(render_table(json.loads(out.read_text())), end="")
    return 0


def _required(packages: list[Package], names: list[str]) -> set[str]:
    """The packages the named ones import, run first so that they are there."""
    by = {p.name: p for p in packages}
    need: set[str] = set()
    todo = list(names)
    while todo:
        for r in by[todo.pop()].requires:
            if r not in need:
                need.add(r)
                todo.append(r)
    return need


if __name__ == "__main__":
    sys.exit(main())
