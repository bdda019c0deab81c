"""docs/performance.md is what ``scripts/gen_performance.py`` makes from the
committed benchmark results, and the generator renders what a result file holds:
its tables from a report's rows, a clear error where a family's file is missing,
the newest file of a family, and prose beside the tables with no figure of its own."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
GEN = ROOT / "scripts" / "gen_performance.py"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    return load_script(GEN, "gen_performance")


def _timing(median_us: float, spread: float = 0.0) -> dict:
    """A bench timing whose inter-quartile range is ``spread`` times its median."""
    half = median_us * spread / 2
    return {"median_us": median_us, "p25_us": median_us - half, "p75_us": median_us + half, "reps": 10, "stop": "stable"}


def test_performance_doc_is_up_to_date():
    out = subprocess.run([sys.executable, str(GEN), "--check"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, f"{out.stderr}\n{out.stdout[-4000:]}"


def test_elementwise_table_renders_a_report(gen):
    rows = [
        {
            "op": "add",
            "dtype": "float32",
            "case": "2^20",
            "status": "ok",
            "numel": 1 << 20,
            "bytes": 12_000_000,
            "flops": 1 << 20,
            "timings": {"opforge": _timing(10.0), "eager": _timing(12.5, spread=0.5), "compiled": None},
            "notes": {"compiled": "not asked (--no-compile)"},
            "floor_us": 11.0,
        },
        {"op": "add", "dtype": "float16", "case": "2^20", "status": "refused: wrong at this size (x)"},
    ]
    report = {"rows": rows}
    assert gen.elementwise_table(gen.by_op([report])) == [
        "| op | dtype | size | opforge us | eager us | vs eager | GB/s | % of limit |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
        "| add | float32 | 2^20 | 10.0 | 12.5 (*) | 1.25x | 1,200 | 110% |",
    ]
    with_compiled = {**rows[0], "timings": {**rows[0]["timings"], "compiled": _timing(2000.0)}}
    compiled_line = "| add | float32 | 2^20 | 10.0 | 12.5 (*) | 2,000.0 | 1.25x | 200.00x | 1,200 | 110% |"
    assert gen.elementwise_table([with_compiled])[2] == compiled_line


def test_ranges_are_computed_from_the_figures(gen):
    assert gen.span([96.2, 108.4, None, 101.0], gen._num, " %") == "96-108 %"
    assert gen.span([1.001, 0.999], gen._x_num, "x") == "1.00x"
    assert gen.span([None], gen._num) == "-"


def test_a_missing_result_file_names_its_glob(gen, tmp_path, capsys):
    with pytest.raises(gen.MissingResult, match=re.escape("'nothing_*_here.json'")):
        gen.pick(tmp_path, gen.Source("nothing_*_here.json"))
    assert gen.pick(tmp_path, gen.Source("nothing_*_here.json", required=False)) is None
    assert gen.main(["--results", str(tmp_path), "--output", str(tmp_path / "performance.md")]) == 2
    first_glob = next(iter(gen.FAMILIES.values()))[0].glob
    assert repr(first_glob) in capsys.readouterr().err
    assert not (tmp_path / "performance.md").exists()


def test_the_newest_file_of_a_family_is_read(gen, tmp_path):
    for name, date in [
        ("run_2026-01-02.json", "2026-01-02T10:00:00"),
        ("run_2026-01-03.json", "2026-01-03T01:00:00"),
        ("run_2026-01-03_later.json", "2026-01-03T02:00:00"),
        ("run_2026-01-03_before.json", "2026-01-03T03:00:00"),
    ]:
        (tmp_path / name).write_text(json.dumps({"date": date}))
    # The date in the name first, then the run's own date; an excluded name is never read.
    picked = gen.pick(tmp_path, gen.Source("run_*.json", exclude=("*_before.json",)))
    assert picked.path.name == "run_2026-01-03_later.json"


def test_prose_beside_the_tables_holds_no_figure(gen):
    # Names that carry digits are not figures: code spans, and these.
    names = re.compile(r"`[^`]*`|\bW4A8\b|\bTF32\b")
    found = {key: re.findall(r"\S*\d\S*", names.sub("", text)) for key, text in gen.PROSE.items()}
    assert not any(found.values()), found
    assert set(gen.FAMILIES) == set(gen.RENDER) == set(gen.TITLES) <= set(gen.PROSE)
