"""Build speed, measured: what a user waits for.

Each case runs in a fresh subprocess with a fresh cache (OPFORGE_CACHE_DIR in a
temporary directory), so nothing is shared but the compiler's page cache:

* ``cold``: the whole op library (``import opforge`` on an empty cache);
* ``warm``: ``import opforge`` again (library cached), opforge's part of the import only;
* ``one``: one small op (square) through opforge's JIT route, minimal headers
  (and, with CUDA, the same op with its CUDA kernel);
* ``inline``: the same op's source through ``torch.utils.cpp_extension.load_inline``
  with ``torch/extension.h`` and pybind11;
* ``rebuild``: rebuild after one op's source changed (the other ops' objects reused);
* ``wheel``: ``pip wheel --no-build-isolation`` of the project, the setuptools route.

``--byo FOLDER`` measures a user's folder (``tests/fixtures/add2_pybind``: a
pybind11 module whose binding includes ``torch/extension.h``), each step a
fresh ``opforge build`` process, against ``torch.utils.cpp_extension.load`` of
the same sources and flags:

* cold, ``OPFORGE_PCH=0`` (no precompiled header), and cold with it (an empty
  cache: the header is precompiled first);
* fully cached (the same folder again);
* warm: a second copy of the folder, the precompiled header in the cache and
  no objects for it (another project that begins with the same torch headers);
* edited: one line appended to the binding, rebuilt (the loop of someone working on it);
* ``load`` cold (an empty build directory) and again (torch finds its build).

Run::

    python benchmarks/build_speed.py [--cases cold,warm] [--repeat 3] [--json FILE]
    python benchmarks/build_speed.py --per-file [--json FILE]   # each translation unit alone
    python benchmarks/build_speed.py --markdown FILE.json       # the README's table
    python benchmarks/build_speed.py --cases "" --byo tests/fixtures/add2_pybind --json FILE

``--repeat N`` runs the cold build N times, each on an empty cache, and
reports the fastest (every run and the load average before it are kept in the
JSON): on a shared machine other work only ever makes a build slower.

``--per-file`` builds the library once, then compiles each translation unit
alone with the exact command ninja ran (``ninja -t commands``), slowest first
(the ops' wrappers are one unit: ``BuildConfig.unity``), and says whether gcc
used a precompiled header where the build asked for one (``-H`` prints ``!`` before
a ``.gch`` it loads, ``x`` before one it rejects; ``-Winvalid-pch`` says why).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
CASES = ("cold", "warm", "one", "inline", "rebuild", "wheel")

SQUARE_INLINE = r"""
#include <torch/extension.h>
torch::Tensor square(const torch::Tensor& x) {
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "square", [&] {
    const scalar_t* v = xc.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, xc.numel(), 32768, [&](int64_t b, int64_t e) { for (int64_t i = b; i < e; ++i) o[i] = v[i] * v[i]; });
  });
  return out;
}
"""

TIMED_IMPORT = "import time, torch; t = time.perf_counter(); import opforge; print(time.perf_counter() - t)"


def _py(code: str, env: dict[str, str]) -> float:
    """Seconds the code takes in a fresh interpreter (the code prints them)."""
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"build_speed: a case failed:\n{res.stderr[-3000:]}")
    return float(res.stdout.strip().splitlines()[-1])


def _cuda_build() -> tuple[bool, list[str]]:
    """Whether this machine's build has CUDA kernels, and for which archs
    (asked in a subprocess: importing opforge here would build the library)."""
    res = subprocess.run(
        [sys.executable, "-c", "from opforge.builder import want_cuda, cuda_archs; w = want_cuda(); print(w, *(cuda_archs() if w else ()))"],
        env={**os.environ, "PYTHONPATH": str(SRC), "OPFORGE_NO_AUTOLOAD": "1"},
        capture_output=True,
        text=True,
    )
    words = (res.stdout.strip().splitlines() or [""])[-1].split()
    return bool(words) and words[0] == "True", words[1:]


def _cpu_name() -> str:
    # opforge.bench.machine by its path: importing the package would import torch
    # and build or load the op library in this process, which only drives builds.
    spec = importlib.util.spec_from_file_location("_opforge_machine", SRC / "opforge" / "machine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cpu_name()


def _gpu_name() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    res = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    names = [n.strip() for n in res.stdout.splitlines() if n.strip()]
    return f"{len(names)} x {names[0]}" if names else None


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _cold(base: dict[str, str], tmp: Path, repeat: int) -> tuple[float, list[dict]]:
    """The fastest of ``repeat`` cold builds, each on its own empty cache; the
    last cache is left in ``base``'s OPFORGE_CACHE_DIR for the warm case."""
    runs = []
    for i in range(repeat):
        cache = Path(base["OPFORGE_CACHE_DIR"]) if i == repeat - 1 else tmp / f"cold-{i}"
        shutil.rmtree(cache, ignore_errors=True)
        load = _load()
        seconds = _py(TIMED_IMPORT, {**base, "OPFORGE_CACHE_DIR": str(cache)})
        runs.append({"seconds": round(seconds, 3), "load_before": load})
        print(f"  cold build {i + 1}/{repeat}: {seconds:.2f} s (load average before: {load})", flush=True)
        if cache != Path(base["OPFORGE_CACHE_DIR"]):
            shutil.rmtree(cache, ignore_errors=True)
    return min(r["seconds"] for r in runs), runs


def _ninja() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    import ninja  # the PyPI package, as the build finds it

    return str(Path(ninja.BIN_DIR) / "ninja")


def per_file(base: dict[str, str]) -> dict:
    """Builds the library on an empty cache, then times each compile alone."""
    cache = Path(base["OPFORGE_CACHE_DIR"])
    shutil.rmtree(cache, ignore_errors=True)
    cold = _py(TIMED_IMPORT, base)
    objects = next(p.parent for p in cache.glob("*.objects/build.ninja"))
    commands = subprocess.run([_ninja(), "-C", str(objects), "-t", "commands"], capture_output=True, text=True, check=True).stdout
    rows = []
    for cmd in commands.splitlines():
        m = re.search(r" -c (\S+) -o (\S+)", cmd)
        if not m:
            continue  # the link
        source = Path(m[1])
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(cmd, shell=True, cwd=objects, check=True, capture_output=True)
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        name = str(source.relative_to(REPO)) if source.is_relative_to(REPO) else str(source)
        if source.name.endswith("_unity.cpp"):  # generated in the object directory
            name = "csrc/ops/*/*.cpp, as one unit"
        rows.append({"file": name, "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "pch": _pch_state(cmd, objects)})
        print(f"  {rows[-1]['file']:<40} {seconds:6.2f} s  (cpu {cpu:5.2f} s)  pch: {rows[-1]['pch']}", flush=True)
    link = [c for c in commands.splitlines() if " -c " not in c]
    link_seconds = None
    if link:
        start = time.perf_counter()
        subprocess.run(link[-1], shell=True, cwd=objects, check=True, capture_output=True)
        link_seconds = round(time.perf_counter() - start, 2)
    pch = []
    for marker in sorted(cache.glob("pch-*/COMPLETE.json")):
        meta = json.loads(marker.read_text())
        pch.append({"seconds": meta.get("seconds"), "size_mb": round(meta.get("size", 0) / 2**20, 1), "headers": meta.get("headers")})
    rows.sort(key=lambda r: -r["seconds"])
    return {
        "cold_build": round(cold, 3),
        "translation_units": rows,
        "link": link_seconds,
        "precompiled_headers": pch,
        "jobs": _ninja_jobs(objects),
    }


def _pch_state(cmd: str, cwd: Path) -> str:
    """The precompiled header's fate by gcc's own account (-H, -Winvalid-pch):
    "used", "rejected: <why>", "not found" or "none" (not asked for)."""
    if " -include " not in cmd:
        return "none"
    argv = shlex.split(cmd)
    i = argv.index("-o")
    argv[i : i + 2] = []  # -fsyntax-only writes nothing
    res = subprocess.run([*argv, "-H", "-fsyntax-only", "-Winvalid-pch"], cwd=cwd, capture_output=True, text=True)
    for line in res.stderr.splitlines():
        if line.startswith("! ") and line.endswith(".gch"):
            return "used"
        if line.startswith("x ") and line.endswith(".gch"):
            why = [w for w in res.stderr.splitlines() if "Winvalid-pch" in w]
            return "rejected" + (f": {why[0].split('warning:', 1)[-1].strip()}" if why else "")
    return "not found"


def _ninja_jobs(objects: Path) -> int | None:
    """The most compiles that overlapped in the build (from .ninja_log)."""
    try:
        lines = [ln.split("\t") for ln in (objects / ".ninja_log").read_text().splitlines() if ln and not ln.startswith("#")]
    except OSError:
        return None
    spans = [(int(a), int(b)) for a, b, *_ in lines]
    return max((sum(1 for s, e in spans if s <= t < e) for t, _ in spans), default=None)


def cases(base: dict[str, str], tmp: Path, which: list[str], repeat: int) -> tuple[list[tuple[str, float, str]], list[dict]]:
    rows: list[tuple[str, float, str]] = []
    cold_runs: list[dict] = []
    if "cold" in which:
        best, cold_runs = _cold(base, tmp, repeat)
        label = "cold build, whole op library (import opforge)" + (f", best of {repeat}" if repeat > 1 else "")
        rows.append((label, best, "opforge JIT"))
    if "warm" in which:
        if "cold" not in which:
            _py(TIMED_IMPORT, base)
        best_warm = min(_py(TIMED_IMPORT, base) for _ in range(3))
        rows.append(("warm import opforge (cached library), best of 3", best_warm, "opforge JIT"))

    if "one" in which:
        one = (
            "import time, torch\nfrom pathlib import Path\nfrom opforge.builder import BuildConfig, csrc_dir, build_library\n"
            "t = time.perf_counter()\n"
            "src = (csrc_dir() / 'ops' / 'square' / 'square.cpp',)\n"
            "build_library(BuildConfig('speed_square', src, (csrc_dir(),), ('-O3', '-fopenmp')), quiet=True)\n"
            "print(time.perf_counter() - t)"
        )  # fmt: skip
        rows.append(("cold build, one small op (square), minimal headers", _py(one, {**base, "OPFORGE_NO_AUTOLOAD": "1"}), "opforge JIT"))
        if _cuda_build()[0]:
            one_cuda = (
                "import time, torch\nfrom opforge.builder import BuildConfig, csrc_dir, build_library, cuda_archs\n"
                "from opforge.builder import gencode_flags\n"
                "t = time.perf_counter()\nd = csrc_dir()\n"
                "sq = d / 'ops' / 'square'\n"
                "src = (sq / 'square.cpp', sq / 'square_kernel.cu', d / 'opforge' / 'aten' / 'cuda_stream.cpp')\n"
                "archs = cuda_archs()\n"
                "cfg = BuildConfig('speed_square_cuda', src, (d,), ('-O3', '-fopenmp', '-DOPFORGE_WITH_CUDA'),\n"
                "                  ('-O3', '-DOPFORGE_WITH_CUDA', *gencode_flags(archs)), with_cuda=True, cuda_archs=archs)\n"
                "build_library(cfg, quiet=True)\n"
                "print(time.perf_counter() - t)"
            )  # fmt: skip
            rows.append(
                ("cold build, one small op with its CUDA kernel", _py(one_cuda, {**base, "OPFORGE_NO_AUTOLOAD": "1"}), "opforge JIT")
            )

    if "inline" in which:
        inline = (
            "import time, torch\nfrom torch.utils.cpp_extension import load_inline\n"
            f"src = {SQUARE_INLINE!r}\n"
            "t = time.perf_counter()\n"
            f"load_inline('speed_inline_square', cpp_sources=src, functions=['square'],\n"
            f"            build_directory={str(tmp / 'inline')!r}, extra_cflags=['-O3'])\n"
            "print(time.perf_counter() - t)"
        )  # fmt: skip
        (tmp / "inline").mkdir()
        rows.append(("cold build, the same op, load_inline + torch/extension.h", _py(inline, base), "torch load_inline"))

    if "rebuild" in which:
        # A copy of csrc with square.cpp edited after a first build.
        csrc = tmp / "csrc"
        shutil.copytree(REPO / "csrc", csrc)
        env_copy = {**base, "OPFORGE_CSRC": str(csrc)}
        rebuild = (
            "import time, torch\nfrom pathlib import Path\nfrom opforge.builder import csrc_dir, library_config, build_library\n"
            "import dataclasses, os\n"
            "cfg = library_config()\n"
            "src = Path(os.environ['OPFORGE_CSRC'])\n"
            "def move(paths): return tuple(src / p.relative_to(csrc_dir()) for p in paths)\n"
            "moved = dataclasses.replace(cfg, sources=move(cfg.sources), unity=move(cfg.unity), include_dirs=(src,))\n"
            "build_library(moved, quiet=True)\n"
            "sq = src / 'ops' / 'square' / 'square.cpp'\n"
            "sq.write_text(sq.read_text() + '\\n// edited\\n')\n"
            "t = time.perf_counter()\n"
            "build_library(moved, quiet=True)\n"
            "print(time.perf_counter() - t)"
        )  # fmt: skip
        rows.append(("rebuild after one op's source changed", _py(rebuild, {**env_copy, "OPFORGE_NO_AUTOLOAD": "1"}), "opforge JIT"))

    if "wheel" in which:
        # The ahead-of-time route: a wheel with the prebuilt library, from a copy of the project.
        project = tmp / "project"
        project.mkdir()
        outputs = shutil.ignore_patterns("*.egg-info", "__pycache__", "*.so", "_C.build.json")
        for part in ("pyproject.toml", "setup.py", "README.md", "src", "csrc"):
            if (REPO / part).is_dir():
                shutil.copytree(REPO / part, project / part, ignore=outputs)
            else:
                shutil.copy2(REPO / part, project / part)
        wheel = (
            "import subprocess, sys, time\nt = time.perf_counter()\n"
            "subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-build-isolation', '--no-deps',\n"
            f"                '-w', {str(tmp / 'wheels')!r},"
            f" {str(project)!r}], check=True, stdout=subprocess.DEVNULL)\n"
            "print(time.perf_counter() - t)"
        )  # fmt: skip
        env_wheel = {k: v for k, v in base.items() if k != "PYTHONPATH"}
        rows.append(("pip wheel --no-build-isolation (whole library, prebuilt)", _py(wheel, env_wheel), "setuptools"))
    return rows, cold_runs


def _run_timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    """The wall time of a command (a fresh interpreter: torch's import included), and its output."""
    start = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"build_speed: {' '.join(cmd)} failed:\n{(res.stdout + res.stderr)[-3000:]}")
    return seconds, res.stdout + res.stderr


_TORCH_LOAD = (
    "import sys\nfrom torch.utils.cpp_extension import load\n"
    "out, includes, sources = sys.argv[1], sys.argv[2].split(','), sys.argv[3:]\n"
    "load(name='byo_torch_load', sources=sources, extra_include_paths=includes, extra_cflags=['-O3'],\n"
    "     build_directory=out, verbose=False)\n"
)


def byo(base: dict[str, str], tmp: Path, folder: Path) -> tuple[list[tuple[str, float, str]], dict]:
    """A user's folder by ``opforge build`` and by torch's ``load``; see the module's doc."""
    env = {**base, "OPFORGE_NO_AUTOLOAD": "1", "OPFORGE_BUILD_CUDA": "0"}
    build = [sys.executable, "-m", "opforge", "build"]
    rows: list[tuple[str, float, str]] = []
    loads: dict[str, float] = {}
    name = folder.name

    def step(label: str, cmd: list[str], cache: Path, route: str, **extra: str) -> str:
        loads[label] = _load()
        seconds, log = _run_timed(cmd, {**env, "OPFORGE_CACHE_DIR": str(cache), **extra})
        rows.append((label, seconds, route))
        print(f"  {label}: {seconds:.2f} s (load average before: {loads[label]})", flush=True)
        return log

    def copy(to: str) -> Path:
        return Path(shutil.copytree(folder, tmp / to / name))

    nopch = [*build, str(copy("nopch"))]
    step(f"{name}: cold, no precompiled header (OPFORGE_PCH=0)", nopch, tmp / "byo-nopch", "opforge build", OPFORGE_PCH="0")
    cache = tmp / "byo-cache"
    first = copy("first")
    log = step(f"{name}: cold, precompiled header built first", [*build, str(first)], cache, "opforge build")
    built_pch = "precompiling" in log
    pch = [json.loads(m.read_text()) for m in cache.glob("pch-*/COMPLETE.json")]
    step(f"{name}: fully cached (the same folder again)", [*build, str(first)], cache, "opforge build")
    second = copy("second")
    step(f"{name}: warm (another folder, precompiled header in the cache)", [*build, str(second)], cache, "opforge build")
    edited = max(second.rglob("*.cpp"), key=lambda p: "torch/" in p.read_text())  # the binding: what someone edits
    edited.write_text(edited.read_text() + "\n// edited\n")
    step(f"{name}: one line of {edited.name} edited, rebuilt", [*build, str(second)], cache, "opforge build")

    sources = sorted(str(p) for p in copy("torch").rglob("*.cpp"))
    includes = ",".join(sorted({str(p.parent) for p in (tmp / "torch" / name).rglob("*.h")} | {str(tmp / "torch" / name)}))
    out = tmp / "torch-build"
    out.mkdir()
    load_cmd = [sys.executable, "-c", _TORCH_LOAD, str(out), includes, *sources]
    step(f"{name}: torch.utils.cpp_extension.load, cold", load_cmd, tmp / "unused", "torch load")
    step(f"{name}: torch.utils.cpp_extension.load, again (its build found)", load_cmd, tmp / "unused", "torch load")
    details = {
        "folder": str(folder.relative_to(REPO) if folder.is_relative_to(REPO) else folder),
        "precompiled_header_built_in_cold_run": built_pch,
        "precompiled_headers": [
            {"headers": p.get("headers"), "seconds": p.get("seconds"), "size_mb": round(p.get("size", 0) / 2**20, 1)} for p in pch
        ],
        "load_before": loads,
        "note": "each step is the wall time of a fresh process (python, torch's import and the build)",
    }
    return rows, details


def markdown(report: dict) -> str:
    """The README's table: one row per case, then the per-file table if measured."""
    where = f"{report.get('gpu') or 'CPU only'}; {report.get('cpu', report.get('machine'))}, {report.get('cores')} cores"
    lines = [
        f"Measured {report['date'][:10]} by `python benchmarks/build_speed.py` ({where}; torch {report['torch']}"
        + (
            f", CUDA kernels for sm {', '.join(report['cuda_archs'])}"
            if report.get("cuda_kernels_built") and report.get("cuda_archs")
            else ""
        )
        + ").",
        "",
        "| case | seconds |",
        "| --- | ---: |",
    ]
    lines += [f"| {r['case']} | {r['seconds']:.2f} |" for r in report.get("rows", [])]
    loads = [r["load_before"] for r in report.get("cold_runs", [])]
    if loads:
        lines += ["", f"Load average before each cold build: {', '.join(str(x) for x in loads)} (other work shared the cores)."]
    per = report.get("per_file")
    if per:
        lines += ["", "| translation unit, compiled alone | seconds | CPU seconds | precompiled header |", "| --- | ---: | ---: | --- |"]
        lines += [f"| `{r['file']}` | {r['seconds']:.2f} | {r.get('cpu_seconds', '-')} | {r['pch']} |" for r in per["translation_units"]]
        for p in per.get("precompiled_headers", []):
            lines.append(f"| precompiled header, built once per torch + compiler + flags ({p['size_mb']} MB) | {p['seconds']:.2f} | | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--repeat", type=int, default=1, help="cold builds to run; the fastest is reported")
    p.add_argument("--per-file", action="store_true", help="also compile each translation unit alone")
    p.add_argument("--markdown", type=Path, default=None, metavar="JSON", help="print the markdown table of a results file and exit")
    p.add_argument("--byo", type=Path, default=None, metavar="FOLDER", help="also a user's folder: opforge build against torch's load")
    p.add_argument("--note", default=None, help="a line kept in the JSON (the machine's state, what else ran)")
    args = p.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())), end="")
        return
    which = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(which) - set(CASES))
    if unknown:
        p.error(f"unknown case(s): {', '.join(unknown)}")

    tmp = Path(tempfile.mkdtemp(prefix="opforge-build-speed-"))
    base = {**os.environ, "PYTHONPATH": str(SRC), "OPFORGE_CACHE_DIR": str(tmp / "cache")}
    rows, cold_runs = cases(base, tmp, which, max(1, args.repeat))
    per = per_file({**base, "OPFORGE_CACHE_DIR": str(tmp / "per-file")}) if args.per_file else None
    byo_details = None
    if args.byo is not None:
        byo_rows, byo_details = byo(base, tmp, args.byo.resolve())
        rows += byo_rows

    import torch

    built_cuda, archs = _cuda_build()
    report = {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "gpu": _gpu_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_kernels_built": built_cuda,
        "cuda_archs": archs,
        "cxx": os.environ.get("CXX", "c++"),
        "jobs": os.environ.get("MAX_JOBS", "ninja's default"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_after": _load(),
        "rows": [{"case": c, "seconds": round(s, 3), "route": r} for c, s, r in rows],
        "cold_runs": cold_runs,
    }
    if per is not None:
        report["per_file"] = per
    if byo_details is not None:
        report["byo"] = byo_details
    if args.note:
        report["note"] = args.note
    print(f"build speed: {report['cpu']}, {os.cpu_count()} cores, torch {torch.__version__}, {report['date'][:10]}")
    width = max((len(c) for c, _, _ in rows), default=0)
    for c, s, r in rows:
        print(f"  {c:<{width}}  {s:7.2f} s  ({r})")
    if per is not None:
        print(f"per file (each alone; cold build of that run {per['cold_build']:.2f} s, up to {per['jobs']} compiles at once):")
        for r in per["translation_units"]:
            print(f"  {r['file']:<40} {r['seconds']:6.2f} s  (cpu {r['cpu_seconds']:5.2f} s)  pch: {r['pch']}")
        for h in per["precompiled_headers"]:
            print(f"  precompiled header ({h['size_mb']} MB)           {h['seconds']:6.2f} s")
        if per["link"] is not None:
            print(f"  link                                     {per['link']:6.2f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
