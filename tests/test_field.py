"""The field harness (``benchmarks/field/run.py``) without the network: its package list, the
verdict of a step, a step killed whole at its time limit, the first error line, results merged
on a rerun, and the table and docs it renders. The harness itself (downloads, hours of builds)
is run by hand, not here."""

from __future__ import annotations

import json
import os
import re
import sys
import tarfile
import time
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import SRC, load_script

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "benchmarks" / "field" / "run.py"


@pytest.fixture(scope="module")
def field() -> ModuleType:
    return load_script(HARNESS, "field_run")


ONE = """
[[package]]
name = "torch-scatter"
version = "2.1.2"
layout = "setup.py"
backends = ["cpu", "cuda"]
modules = ["torch_scatter"]
"""


def test_the_committed_list_parses_with_fifteen_packages_and_their_specs(field):
    packages = field.parse_list((ROOT / "benchmarks" / "field" / "packages.toml").read_text())
    assert len(packages) >= 15
    assert {"cpu"} < {b for p in packages for b in p.backends}
    assert any(p.backends == ("cuda",) for p in packages), "no CUDA-only package"
    for p in packages:
        if p.spec:
            assert (HARNESS.parent / p.spec).is_file(), p.spec
            # The spec's folder is on sys.path when it runs: named as the package, it would import itself.
            assert Path(p.spec).stem not in {m.split(".")[0] for q in packages for m in q.modules}, p.spec


def test_a_package_parses(field):
    (p,) = field.parse_list(ONE)
    assert (p.name, p.version, p.backends, p.modules, p.tests, p.spec) == (
        "torch-scatter", "2.1.2", ("cpu", "cuda"), ("torch_scatter",), (), "",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (('version = "2.1.2"', 'version = ">=2.1"'), "version must be a pinned version (2.1.2), got '>=2.1'"),
        (('version = "2.1.2"', ""), "version must be a non-empty string, got None"),
        (('backends = ["cpu", "cuda"]', 'backends = ["tpu"]'), "backends must be a list of cpu and cuda, got ['tpu']"),
        (('modules = ["torch_scatter"]', "modules = []"), "modules must name the modules its users import, got []"),
        (('layout = "setup.py"', 'layout = "setup.py"\nsdist = "x"'), "unknown key sdist"),
        (('layout = "setup.py"', 'layout = "setup.py"\nrequires = ["torch-nope"]'), "requires torch-nope, which the list"),
        (('layout = "setup.py"', 'layout = "setup.py"\ntests = "tests"'), "tests must be a list of pytest arguments, got 'tests'"),
    ],
)
def test_a_bad_entry_is_named_with_its_value(field, edit, message):
    with pytest.raises(field.ListError, match="package torch-scatter: ") as info:
        field.parse_list(ONE.replace(*edit), "list.toml")
    assert message in str(info.value)
    assert str(info.value).startswith("list.toml: ")


def test_a_package_listed_twice_or_an_empty_list_is_refused(field):
    with pytest.raises(field.ListError, match="package torch-scatter: listed twice"):
        field.parse_list(ONE + ONE)
    with pytest.raises(field.ListError, match=r"no \[\[package\]\] entries"):
        field.parse_list("")
    with pytest.raises(field.ListError, match="not TOML"):
        field.parse_list("[[package]\n")


def test_a_verdict_outside_the_four_is_refused(field):
    with pytest.raises(ValueError, match="verdict must be one of pass, fail, n/a, skip, got 'ok'"):
        field.Step("ok")


def test_verdicts_from_exit_codes(field):
    Ran = field.Ran
    assert field.verdict_of(Ran(0, 1.5, "all good\n"), 60).as_dict() == {"verdict": "pass", "seconds": 1.5, "first_error": ""}
    failed = field.verdict_of(Ran(1, 2.0, "building...\nsrc/a.cpp:3:10: fatal error: cuda_runtime.h: No such file\n"), 60)
    assert (failed.verdict, failed.first_error) == ("fail", "src/a.cpp:3:10: fatal error: cuda_runtime.h: No such file")
    timed_out = field.verdict_of(Ran(None, 60.2, "compiling x.cu\n"), 60)
    assert timed_out.verdict == "fail"
    assert timed_out.first_error == "time limit (60 s) reached: killed; last line: compiling x.cu"
    signalled = field.verdict_of(Ran(-11, 0.3, ""), 60)
    assert signalled.first_error.startswith("killed by signal 11")
    # A package whose own build cannot work here (CUDA only, on a CPU machine).
    assert field.verdict_of(Ran(1, 3.0, "OSError: CUDA_HOME environment variable is not set\n"), 60, when_fails="n/a").verdict == "n/a"


def test_steps_after_a_failed_build_are_not_applicable(field):
    assert field.following(field.Step("fail", 3.0, "x"), "import").as_dict() == {
        "verdict": "n/a", "seconds": 0.0, "first_error": "build failed",
    }  # fmt: skip
    assert field.following(field.Step("pass", 3.0), "import") is None


@pytest.mark.parametrize(
    ("output", "first"),
    [
        ("Traceback (most recent call last):\n  File x\nImportError: undefined symbol: _Z3foov\n",
         "ImportError: undefined symbol: _Z3foov"),
        ("opforge: building x (3 sources)...\nopforge: x: cannot write y: the folder z is not there\n",
         "opforge: x: cannot write y: the folder z is not there"),
        ("  error: subprocess-exited-with-error\n  OSError: CUDA_HOME environment variable is not set.\n",
         "OSError: CUDA_HOME environment variable is not set."),
        ("....F\nFAILED tests/test_ops.py::test_sort - AssertionError\n1 failed, 4 passed\n",
         "FAILED tests/test_ops.py::test_sort - AssertionError"),
        ("check f: reference pass (14), opcheck FAIL (5/5)\nx opcheck: f float32 [5x7]: OpCheckError: numel()\n3 passed, 3 failed\n",
         "x opcheck: f float32 [5x7]: OpCheckError: numel()"),
        ("      File \"<string>\", line 111\n      NameError: name 'v' is not defined\nerror: metadata-generation-failed\nhint: see\n",
         "NameError: name 'v' is not defined"),
        ("opforge build: setup.py failed (exit 1) when read:\nTraceback (most recent call last):\n  File x\nKeyError: 'a'\nValueError: b\n",
         "opforge build: setup.py failed (exit 1) when read: ValueError: b"),
        ("bench f - -: refused: fails its reference check (x)\n| f | refused |\nwarning: the machine is busy\n",
         "bench f - -: refused: fails its reference check (x)"),
        ("nothing matched here\nlast words\n\n", "last words"),
        ("", ""),
    ],
)  # fmt: skip
def test_the_first_error_line(field, output, first):
    assert field.first_error(output) == first


def test_a_long_error_line_keeps_its_start_and_its_end(field):
    assert field.first_error("RuntimeError: " + "x" * 500 + " the end", limit=40) == "RuntimeError:" + " ... " + "x" * 14 + " the end"


def test_a_step_past_its_limit_is_killed_with_the_processes_it_started(field, tmp_path):
    # The step starts a grandchild in a process group of its own, as ninja starts each compile
    # command: killing the step's group alone would leave it running.
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import os, subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], preexec_fn=os.setpgrp)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(600)\n"
    )
    start = time.monotonic()
    ran = field.run_limited([sys.executable, "-c", script], cwd=tmp_path, env=dict(os.environ), limit=3, log=tmp_path / "log")
    assert ran.rc is None
    assert time.monotonic() - start < 30
    assert "started" in ran.output and (tmp_path / "log").read_text() == ran.output
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # the kill is sent; the process may take a moment to be reaped by init
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild), "the step's grandchild survived the time limit"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_a_step_that_ends_in_time_keeps_its_exit_code(field, tmp_path):
    ran = field.run_limited([sys.executable, "-c", "print('hi'); raise SystemExit(3)"], cwd=tmp_path, env=dict(os.environ), limit=60)
    assert (ran.rc, ran.output.strip()) == (3, "hi")


def _row(field, name: str, **verdicts: str) -> dict:
    row = {"name": name, "version": "1.0", "layout": "setup.py | pybind11", "backends": ["cpu"]}
    for step in field.STEPS:
        v = verdicts.get(step, "pass")
        row[step] = {
            "verdict": v,
            "seconds": 12.3 if v in ("pass", "fail") else 0.0,
            "first_error": "" if v == "pass" else f"{step} broke `here`",
        }
    return row


def test_a_rerun_replaces_its_packages_rows_only(field):
    old = [_row(field, "a"), _row(field, "b", build="fail")]
    merged = field.merge_rows(old, [_row(field, "b")])
    assert [r["name"] for r in merged] == ["a", "b"]
    assert merged[1]["build"]["verdict"] == "pass"


def test_the_table_gives_every_row_the_totals_and_each_failure(field):
    rows = [_row(field, "a"), _row(field, "b", build="fail", **{s: "n/a" for s in ("import", "own_tests", "check", "bench")})]
    result = {"device": "cpu", "machine": "2 cores", "torch": "2.13.0", "date": "2026-11-29", "jobs": 2, "rows": rows}
    table = field.render_table(result)
    assert table.startswith("2 packages, cpu (2 cores), torch 2.13.0, 2026-11-29, MAX_JOBS=2:")
    assert "| package | layout | own install | own tests, own install | opforge build | import | own tests, opforge's build |" in table
    assert "| a 1.0 | setup.py / pybind11 | pass 12 s | pass 12 s | pass 12 s | pass 12 s |" in table
    assert "| b 1.0 | setup.py / pybind11 | pass 12 s | pass 12 s | fail 12 s | n/a | n/a | n/a | n/a |" in table
    assert "| **totals** | | 2 pass | 2 pass | 1 pass, 1 fail | 1 pass, 1 n/a |" in table
    assert "- b, opforge build (fail): `build broke 'here'`" in table
    assert "- b, own tests, opforge's build (n/a): `own_tests broke 'here'`" in table
    rows[1]["check"]["first_error"] = "build failed"  # said by the build's own line: not repeated
    assert "- b, check" not in field.render_table(result)
    assert field.totals(rows)["build"] == {"pass": 1, "fail": 1, "n/a": 0, "skip": 0}


def test_the_docs_tables_come_from_the_newest_file_of_each_device(field, tmp_path):
    docs = tmp_path / "field.md"
    docs.write_text("# Field\n\n<!-- field-table:cpu -->\nold\n<!-- /field-table:cpu -->\n\nafter\n")
    for date, verdict in (("2026-11-01", "fail"), ("2026-11-29", "pass")):
        result = {"device": "cpu", "date": date, "jobs": 2, "rows": [_row(field, "a", build=verdict)]}
        (tmp_path / f"field_cpu_{date}.json").write_text(json.dumps(result))
    field.write_docs(sorted(tmp_path.glob("field_*.json")), docs)
    text = docs.read_text()
    assert "From `benchmarks/results/field_cpu_2026-11-29.json`." in text
    assert "old" not in text and text.endswith("<!-- /field-table:cpu -->\n\nafter\n")
    assert "| **totals** | | 1 pass | 1 pass | 1 pass |" in text


def test_docs_without_a_devices_markers_is_an_error(field, tmp_path):
    docs = tmp_path / "field.md"
    docs.write_text("# Field\n")
    (tmp_path / "field_cuda_2026-11-29.json").write_text(json.dumps({"device": "cuda", "rows": []}))
    with pytest.raises(SystemExit, match=re.escape("no <!-- field-table:cuda --> ... <!-- /field-table:cuda --> markers")):
        field.write_docs([tmp_path / "field_cuda_2026-11-29.json"], docs)


def test_an_unknown_package_name_is_a_usage_error(field, capsys):
    with pytest.raises(SystemExit) as info:
        field.main(["torch-nope"])
    assert info.value.code == 2
    assert "not in packages.toml: torch-nope; it lists torch-scatter" in capsys.readouterr().err


def test_a_bad_limit_is_a_usage_error(field, capsys):
    with pytest.raises(SystemExit):
        field.main(["--limit", "build=soon"])
    assert "--limit 'build=soon': want STEP=SECONDS" in capsys.readouterr().err


def test_a_package_needs_the_packages_it_imports(field):
    packages = field.parse_list((ROOT / "benchmarks" / "field" / "packages.toml").read_text())
    assert field._required(packages, ["torch-sparse"]) == {"torch-scatter"}


def test_a_package_runs_through_every_step_and_a_failed_build_stops_the_rest(field, tmp_path):
    # A pure-Python sdist: its own install and its tests pass; opforge finds nothing to build in it.
    src = tmp_path / "make" / "tinypkg-1.0"
    (src / "tinypkg").mkdir(parents=True)
    (src / "tinypkg" / "__init__.py").write_text("VALUE = 3\n")
    (src / "tests").mkdir()
    (src / "tests" / "test_value.py").write_text("import tinypkg\n\ndef test_value():\n    assert tinypkg.VALUE == 3\n")
    (src / "setup.py").write_text("from setuptools import setup\nsetup(name='tinypkg', version='1.0', packages=['tinypkg'])\n")
    sdists = tmp_path / "sdists"
    sdists.mkdir()
    with tarfile.open(sdists / "tinypkg-1.0.tar.gz", "w:gz") as t:
        t.add(src, arcname="tinypkg-1.0")
    (p,) = field.parse_list(
        ONE.replace("torch-scatter", "tinypkg").replace("2.1.2", "1.0").replace("torch_scatter", "tinypkg") + 'tests = ["tests"]\n'
    )
    setup = field.Setup("cpu", sys.executable, Path(SRC), 1, tmp_path / "work", sdists, dict(field.LIMITS))
    row = field.run_package(p, setup, {}, tmp_path / "logs")
    verdicts = {step: row[step]["verdict"] for step in field.STEPS}
    assert verdicts == {
        "own_install": "pass", "own_tests_own_install": "pass", "build": "fail",
        "import": "n/a", "own_tests": "n/a", "check": "n/a", "bench": "n/a",
    }, row  # fmt: skip
    assert "1 passed" in row["own_tests_own_install"]["first_error"]
    assert row["build"]["first_error"], "a failed build names its error"
    assert row["import"]["first_error"] == "build failed"
    assert row["check"]["first_error"] == "no spec: it exposes no operator in torch.ops to name"
    assert (tmp_path / "logs" / "build.log").is_file()


def test_rescore_reads_failed_steps_again_and_keeps_what_came_before_their_cause(field, tmp_path):
    row = _row(field, "a", own_install="n/a", build="fail", own_tests="n/a", check="fail")
    row["own_install"]["first_error"] = "cuda only, this machine: cpu; hint: see above"
    row["own_tests"]["first_error"] = "build failed"
    row["check"]["first_error"] = "ValueError: a; pass name=, e.g. name='x'"
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "check.log").write_text("ValueError: a; pass name=, e.g. name='x'\n")
    (tmp_path / "a" / "own_install.log").write_text("Traceback\n  NameError: name 'v' is not defined\nhint: see above\n")
    (tmp_path / "a" / "build.log").write_text("src/x.cpp:3:1: error: 'y' was not declared\n")
    (tmp_path / "a" / "own_tests.log").write_text("E   AssertionError\n")  # from another run: this one did not run them
    result = {"device": "cpu", "rows": [row]}
    assert field.rescore(result, tmp_path) == 2
    assert row["own_install"]["first_error"] == "cuda only, this machine: cpu; NameError: name 'v' is not defined"
    assert row["build"]["first_error"] == "src/x.cpp:3:1: error: 'y' was not declared"
    assert row["own_tests"]["first_error"] == "build failed"
    assert row["check"]["first_error"] == "ValueError: a; pass name=, e.g. name='x'"
