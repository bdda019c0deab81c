"""The command line and the operators' entry points given what they cannot take:
every refusal is one line naming the option or argument and the value, with the
exit status of a usage error (2), and nothing is measured, removed or written first."""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import opforge
from opforge import cli
from opforge.cli.args import NumericOption

# What no numeric option takes: not a number, infinities, negative, past any sane bound.
HOSTILE_NUMBERS = ["nan", "NaN", "-nan", "inf", "-inf", "-1", "-0.5", "1e400", "-1e400", "1e300", str(10**30), str(2**63), str(2**64)]


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path of subcommand words, parser) for the parser and every subparser under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, (*path, name))


def _numeric_options() -> list[tuple[tuple[str, ...], str, NumericOption]]:
    found = []
    for path, parser in _subcommands(cli.build_parser()):
        for action in parser._actions:
            if isinstance(action.type, NumericOption):
                found.append((path, action.option_strings[-1], action.type))
    return found


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line of stderr of a usage error, asserting exit 2."""
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2, argv
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_every_numeric_option_takes_a_checked_type():
    """A number parsed by int or float takes NaN, infinities or negatives: every option
    that parses a number does it through NumericOption (a new one is then walked below)."""
    for path, parser in _subcommands(cli.build_parser()):
        for action in parser._actions:
            assert action.type not in (int, float), f"opforge {' '.join(path)} {action.option_strings}: type={action.type.__name__}"
    names = {(" ".join(p), o) for p, o, _ in _numeric_options()}
    for expected in [("cache clean", "--older-than"), ("check", "--seed"), ("check", "--seeds"), ("check", "--time-limit"),
                     ("bench", "--budget"), ("bench", "--seed"), ("run", "--time-limit"), ("profile", "--seed")]:  # fmt: skip
        assert expected in names


@pytest.mark.parametrize("value", HOSTILE_NUMBERS)
def test_every_numeric_option_refuses_hostile_numbers(value, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    options = _numeric_options()
    assert len(options) >= 10
    for path, option, _ in options:
        line = _refused([*path, f"{option}={value}"], capsys)
        assert f"argument {option}: expected " in line and repr(value) in line, line
        assert line.startswith(f"opforge {' '.join(path)}: error: "), line


def test_a_numeric_option_takes_its_bounds():
    for _, option, kind in _numeric_options():
        lowest = kind.low + (0.5 if kind.low_open else 0)
        for value in (kind.high, lowest):
            text = str(value if kind.kind is float else int(value))
            assert kind(text) == kind.kind(text), (option, text)
    seed = next(k for _, o, k in _numeric_options() if o == "--seed")
    assert seed(str(2**63 - 1)) == 2**63 - 1
    with pytest.raises(argparse.ArgumentTypeError, match=r"2\^63 - 1, got '9223372036854775808'"):
        seed(str(2**63))


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e400", "-0.001"])
def test_cache_clean_older_than_nan_removes_nothing(value, tmp_path, monkeypatch, capsys):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(root))
    kept = []
    for i in range(random.randint(2, 4)):
        d = root / f"lib_{i}-{'ab' * 8}"
        d.mkdir()
        (d / f"lib_{i}.so").write_bytes(os.urandom(100))
        (d / "COMPLETE.json").write_text('{"size": 100, "sha256": "x", "seconds": 1.0}')
        t = time.time() - random.uniform(1, 400) * 86400
        os.utime(d, (t, t))
        kept.append(d)
    line = _refused(["cache", "clean", "--older-than", value], capsys)
    assert f"argument --older-than: expected a number of days from 0 to 36500, got {value!r}" in line
    assert all(d.is_dir() for d in kept)


def test_the_profile_runner_refuses_hostile_numbers(capsys):
    from opforge.cli.profile import runner_main

    for option in ("--seed", "--warmup"):
        for value in ("nan", "-1", "1e400", str(10**30)):
            with pytest.raises(SystemExit) as stop:
                runner_main(["--run-case", "add", "2^16", "float32", option, value])
            assert stop.value.code == 2
            (line,) = capsys.readouterr().err.strip().splitlines()
            assert f"argument {option}: expected an integer" in line and repr(value) in line


# ---------------------------------------------------------------- files to write and read


def _never_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Anything measured or checked fails the test: the refusal must come first."""

    def ran(*args, **kwargs):
        raise AssertionError("ran before refusing")

    monkeypatch.setattr(cli.bench, "bench_ops", ran)
    monkeypatch.setattr(cli.bench, "check_ops", ran)


def _unwritable(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Paths that cannot be written, by kind, and what the error says of each."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    a_folder = tmp_path / "a_folder"
    a_folder.mkdir()
    return {
        "parent missing": (str(tmp_path / "missing" / "out"), "does not exist"),
        "parent is a file": (str(a_file / "out"), "is not a folder"),
        "is a folder": (str(a_folder), "is a folder; give a file name"),
        "empty": ("", "expected a file name"),
        "read-only file system": ("/proc/opforge-out", "cannot write /proc/opforge-out"),
    }


@pytest.mark.parametrize("command", ["bench", "run"])
@pytest.mark.parametrize("option", ["--json", "--csv", "--plot"])
def test_an_unwritable_output_is_refused_before_anything_runs(command, option, tmp_path, monkeypatch, capsys):
    _never_run(monkeypatch)
    monkeypatch.chdir(tmp_path)
    for kind, (path, says) in _unwritable(tmp_path).items():
        line = _refused([command, "--device", "cpu", option, path], capsys)
        assert f"argument {option}: " in line and says in line, (kind, line)


def test_a_writable_output_is_left_as_it_was(tmp_path, monkeypatch):
    from opforge.cli.args import output_file

    existing = tmp_path / "old.json"
    text = os.urandom(8).hex()
    existing.write_text(text)
    assert output_file(str(existing)) == existing and existing.read_text() == text
    assert output_file(str(tmp_path / "new.csv")) == tmp_path / "new.csv"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"], "the probe leaves nothing behind"


@pytest.mark.parametrize("command", ["bench", "run"])
def test_sweeps_default_plot_in_an_unwritable_folder_is_refused_first(command, monkeypatch, capsys):
    _never_run(monkeypatch)
    monkeypatch.chdir("/proc")
    line = _refused([command, "add", "--device", "cpu", "--sweep"], capsys)
    assert "--sweep's plot goes in the current folder by default" in line and "--plot" in line


def test_a_file_that_fails_to_write_after_the_run_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    from opforge.bench import run as bench

    def full_disk(report, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench, "write_json", full_disk)
    opts = cli.BenchOptions(json_path=tmp_path / "out.json")
    assert cli.write_outputs(SimpleNamespace(device_name="cpu"), opts) is False
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"opforge: cannot write {tmp_path / 'out.json'}: No space left on device"


def _report(median: object = 12.5) -> dict:
    timing = {"median_us": median, "p25_us": 10.0, "p75_us": 15.0, "reps": 9, "stop": "stable"}
    row = {"op": "add", "dtype": "float32", "case": "2^16", "status": "ok", "timings": {"opforge": timing}}
    return {"device": "cpu", "device_name": "cpu", "driver": None, "torch_version": torch.__version__, "cuda_version": None,
            "threads": 1, "git_commit": None, "date": "2026-01-01", "rows": [row]}  # fmt: skip


BAD_COMPARES = {
    "empty": (b"", "is empty"),
    "blank": (b"  \n", "is empty"),
    "corrupt": (b'{"device": "cpu", "rows": [', "is not JSON (Expecting value at line 1"),
    "not UTF-8": (b"\xff\xfe\x00garbage", "is not JSON"),
    "a list": (b"[1, 2]", "a JSON list, not an object"),
    "a string": (b'"bench"', "a JSON str, not an object"),
    "null": (b"null", "a JSON NoneType, not an object"),
    "foreign object": (b'{"name": "something else"}', "no device, device_name, torch_version, date, rows"),
    "rows not a list": (json.dumps({**_report(), "rows": {"a": 1}}).encode(), "rows is not a list"),
    "row of nothing": (json.dumps({**_report(), "rows": [{"op": "add"}]}).encode(), "row 0 has no op, dtype, case and status"),
    "timing as text": (json.dumps(_report("fast")).encode(), "the timing of opforge has no times"),
    "zero timing": (json.dumps(_report(0)).encode(), "the timing of opforge has no times"),
    "NaN timing": (json.dumps(_report(float("nan"))).encode(), "the timing of opforge has no times"),
    "unknown field": (json.dumps({**_report(), "colour": "blue"}).encode(), "unexpected keyword argument 'colour'"),
}


@pytest.mark.parametrize("command", ["bench", "run"])
@pytest.mark.parametrize("kind", sorted(BAD_COMPARES))
def test_compare_with_a_file_not_of_bench_json_is_refused_first(command, kind, tmp_path, monkeypatch, capsys):
    _never_run(monkeypatch)
    data, says = BAD_COMPARES[kind]
    path = tmp_path / f"{kind.replace(' ', '_')}.json"
    path.write_bytes(data)
    line = _refused([command, "--device", "cpu", "--compare", str(path)], capsys)
    assert f"argument --compare: {path}" in line and says in line, line


def test_compare_takes_a_report_of_bench_json(tmp_path):
    from opforge.bench.results import read_json
    from opforge.cli.args import bench_json

    path = tmp_path / "old.json"
    path.write_text(json.dumps(_report(random.uniform(1, 100))))
    assert bench_json(str(path)) == path and read_json(path).rows[0].op == "add"


# ---------------------------------------------------------------- exit codes


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["new", "123bad"], "NAME '123bad' is not a valid identifier"),
        (["new", "class"], "NAME 'class' is a Python keyword"),
        (["new", "my_op", "--namespace", "aten"], "namespace 'aten' collides with an existing torch.ops namespace"),
        (["new", "my_op", "--stable-abi", "--torch-min", "abc"], "--torch-min 'abc' is not a torch version"),
        (["new", "my_op", "--stable-abi", "--torch-min", "1.9"], "the stable ABI is versioned from torch 2.10 on"),
        (["new", "my_op", "--torch-min", "2.10"], "--torch-min goes with --stable-abi"),
        (["new", "my_op", "--dir", "full"], "full is not empty"),
    ],
)
def test_new_usage_errors_exit_2(args, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    line = _refused(args, capsys)
    assert line.startswith("opforge new: ") and says in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"], "nothing written"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["profile", "nosuchop"], "opforge profile: nosuchop: no operator named 'nosuchop'"),
        (["profile", "./nosuchdir"], "opforge profile: ./nosuchdir: no such directory"),
        (["profile", "nothere.py"], "opforge profile: nothere.py: no such file"),
        (["profile", "add", "--dtype", "int7"], "opforge profile: add: "),
    ],
)
def test_profile_of_what_is_not_there_exits_2(args, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        raise SystemExit(cli.main(args))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert says in err, err


@pytest.mark.parametrize("command", ["check", "bench", "run"])
def test_device_cuda_without_a_gpu_exits_2(command, monkeypatch, capsys):
    _never_run(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _refused([command, "add", "--device", "cuda"] if command != "run" else [command, "--device", "cuda"], capsys)
    assert "--device cuda but torch sees no GPU" in line


@pytest.mark.parametrize("command", ["bench", "run"])
def test_graph_off_a_gpu_is_refused_first(command, monkeypatch, capsys):
    _never_run(monkeypatch)
    line = _refused(
        [command, "add", "--device", "cpu", "--graph"] if command == "bench" else [command, "--device", "cpu", "--graph"], capsys
    )
    assert "--graph replays CUDA graphs, which run on a GPU only; the device is cpu (drop --graph)" in line


# ---------------------------------------------------------------- the operators' entry points


def _all_none_call(spec):
    """Arguments with None for every tensor (and a plain number for every other required argument)."""
    args = []
    for a in spec.schema.arguments:
        kind = str(a.type)
        if "Tensor" in kind:
            args.append(None)
        elif a.default_value is not None or a.kwarg_only:
            break
        else:
            args.append({"float": 1.0, "int": 1}[kind])
    return args


@pytest.mark.parametrize("entry", ["opforge", "torch.ops"])
def test_a_call_without_a_tensor_names_the_operator_and_argument(entry):
    specs = [s for s in opforge.all_specs() if s.namespace == "opforge"]
    assert len(specs) >= 8
    for spec in specs:
        fn = spec.function if entry == "opforge" else getattr(torch.ops.opforge, spec.name)
        first = next(a.name for a in spec.schema.arguments if str(a.type) == "Tensor")
        with pytest.raises(TypeError) as info:
            fn(*_all_none_call(spec))
        assert str(info.value).startswith(f"{spec.qualname}: {first} must be a Tensor, got NoneType (None)"), str(info.value)


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda x, y: opforge.axpby(x, y, 10**400), "opforge::axpby: alpha=1e400 is out of range"),
        (lambda x, y: opforge.axpby(x, y, -(7 * 10**400)), "opforge::axpby: alpha=-7e400 is out of range"),
        (lambda x, y: opforge.axpby(x, y, beta=2**1100), "opforge::axpby: beta=~1.35e331 is out of range"),
        (lambda x, y: opforge.axpby(x, y, 1.0, 10**309), "opforge::axpby: beta=1e309 is out of range"),
        (lambda x, y: opforge.qqq_gemm(x, y, x, y, None, 2**64), "opforge::qqq_gemm: group_size=18446744073709551616 is out of range"),
        (lambda x, y: opforge.qqq_gemm(x, y, x, y, None, -(10**25)), "opforge::qqq_gemm: group_size=-1e25 is out of range"),
    ],
)
def test_a_number_out_of_its_types_range_is_named(call, says):
    x, y = torch.randn(random.randint(1, 64)), torch.randn(1)
    with pytest.raises(OverflowError) as info:
        call(x, y)
    assert str(info.value).startswith(says), str(info.value)


def test_a_number_in_range_still_runs():
    x, y = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    alpha = random.randint(2, 10**300)  # a Python int a double can hold
    torch.testing.assert_close(opforge.axpby(x, y, alpha, 1), float(alpha) * x + y)


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev"])
def test_torch_func_reverse_mode_names_the_operator(transform):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    reached = 0
    for spec in opforge.all_specs():
        if spec.namespace != "opforge" or not spec.differentiable or spec.backward is None:
            continue
        sample = next(iter(spec.samples(torch.device("cpu"), torch.float64, gen)))
        tensors = [i for i, a in enumerate(sample.args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        first = tensors[0]

        def f(t, sample=sample, first=first, spec=spec):
            args = list(sample.args)
            args[first] = t
            out = spec.function(*args, **sample.kwargs)
            return (out[0] if isinstance(out, tuple) else out).sum()

        x = sample.args[first]
        with pytest.raises(RuntimeError) as info:
            if transform == "grad":
                torch.func.grad(f)(x)
            elif transform == "vjp":
                torch.func.vjp(f, x)[1](torch.ones(()))
            else:
                torch.func.jacrev(f)(x)
        message = str(info.value)
        assert message.startswith(f"{spec.qualname}: torch.func's reverse-mode transforms"), message
        assert "torch.autograd.grad" in message
        reached += 1
    assert reached >= 4
