"""The measuring harness: statistics, the stop rule, input rotation, cost
models, ceilings, writers, comparison and plot. No timing is asserted here:
speed targets live in committed benchmark results, not in unit tests."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from opforge.bench import ceilings
from opforge.bench import run as bench
from opforge.bench.run import BenchReport, BenchRow, Timing, compare, input_sets, repeat_until_stable
from opforge.check.run import generator
from opforge.opspec import Sample
from opforge.registry import all_specs


def test_timing_statistics():
    t = Timing.of([10.0, 11.0, 12.0, 13.0, 100.0], "stable")
    assert t.median_us == 12.0 and t.p25_us == 11.0 and t.p75_us == 13.0 and t.reps == 5
    assert t.spread == pytest.approx(2 / 12)
    one = Timing.of([5.0], "budget")
    assert one.median_us == one.p25_us == one.p75_us == 5.0 and one.spread == 0


def test_stop_rule_stops_when_stable():
    calls = []

    def batch(k):
        calls.append(k)
        return [100.0 + 0.1 * (i % 3) for i in range(k)]

    t = repeat_until_stable(batch, budget_s=60, min_reps=10)
    assert t.stop == "stable" and t.reps == 10 and t.spread < 0.01


def test_stop_rule_stops_on_budget_when_noisy():
    noisy = itertools.cycle([50.0, 100.0, 150.0, 200.0])
    ticks = itertools.count(0.0, 0.25)  # a fake clock: each batch costs 0.25 s

    t = repeat_until_stable(lambda k: [next(noisy) for _ in range(k)], budget_s=1.0, clock=lambda: next(ticks))
    assert t.stop == "budget" and t.spread > 0.01 and 10 <= t.reps <= 60


def test_stop_rule_max_reps():
    noisy = itertools.cycle([1.0, 3.0])
    t = repeat_until_stable(lambda k: [next(noisy) for _ in range(k)], budget_s=1e9, max_reps=25)
    assert t.stop == "max reps" and t.reps == 25


def test_sides_are_timed_in_turns_and_a_failing_side_is_reported():
    order = []

    def side(name, fail_after=None):
        def fn(x):
            order.append(name)
            if fail_after is not None and order.count(name) > fail_after:
                raise ValueError(f"{name} broke")
            return x + 1

        return fn

    x = torch.randn(8)
    sets = [Sample((x,), {}, "tiny")]
    timer = bench.Timer(torch.device("cpu"))
    sides = {"a": (side("a"), sets), "b": (side("b"), sets), "broken": (side("broken", fail_after=5), sets)}
    got = bench.time_interleaved(sides, timer, budget_s=0.05, graph=False)
    assert isinstance(got["a"], Timing) and isinstance(got["b"], Timing) and got["a"].reps >= 10
    assert isinstance(got["broken"], ValueError) and "broken broke" in str(got["broken"])
    # Warm-ups first (3 calls each), then batches of 10 in rotation: "a" and "b" alternate
    # until one of them stops; the other then goes on alone.
    timed = [n for n in order[9:] if n != "broken"]
    runs = [len(list(g)) for _, g in itertools.groupby(timed)]
    assert len(runs) >= 2 and all(r == 10 for r in runs[:-1]) and runs[-1] % 10 == 0, runs


def test_the_spin_before_a_gpu_call_outlasts_what_the_host_takes_to_queue_it():
    from opforge.bench.timing import _SPIN_CYCLES, _SPIN_HOST_MARGIN, spin_cycles

    assert spin_cycles(0.0, 1980.0) == _SPIN_CYCLES  # a short host side: the default spin
    assert spin_cycles(20.0, 1980.0) == _SPIN_CYCLES
    long_host = spin_cycles(200.0, 2000.0)  # 200 us of host work at 2000 cycles a us
    assert long_host == int(_SPIN_HOST_MARGIN * 200.0 * 2000.0) > _SPIN_CYCLES


def test_input_sets_rotate_only_what_fits_in_cache():
    gen = generator(torch.device("cpu"), 0)
    small = Sample((torch.randn(1000), torch.randn(1000)), {"alpha": 2.0}, "small")
    sets = input_sets(small, l2_bytes=64_000, gen=gen)
    assert len(sets) == 16  # 8 KB per set: on the CPU, sets enough to fill twice the 64 KB cache
    for s in sets[1:]:
        assert s.kwargs == {"alpha": 2.0}
        assert not torch.equal(s.args[0], small.args[0])
        assert s.args[0].data_ptr() != small.args[0].data_ptr()
        assert torch.equal(s.args[0].sort().values, small.args[0].sort().values)  # same values, new order
    assert len(input_sets(Sample((torch.randn(10),), {}, "tiny"), l2_bytes=1 << 25, gen=gen)) == 1024  # the cap
    big = Sample((torch.randn(100_000),), {}, "big")
    assert len(input_sets(big, l2_bytes=64_000, gen=gen)) == 1


def test_input_sets_keep_each_tensors_layout():
    gen = generator(torch.device("cpu"), 0)
    t = torch.randn(40, 30).t()
    cl = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    sliced = torch.randn(40, 30)[:, ::3]
    expanded = torch.randn(30, 1).expand(30, 20)
    sets = input_sets(Sample((t, cl, sliced, expanded), {}, "layouts"), l2_bytes=64_000, gen=gen)
    assert len(sets) > 2
    for s in sets[1:]:
        for new, old in zip(s.args[:3], (t, cl, sliced), strict=True):
            assert new.shape == old.shape and new.stride() == old.stride() and new.data_ptr() != old.data_ptr()
            assert torch.equal(new.flatten().sort().values, old.flatten().sort().values)
        assert s.args[3] is expanded  # its elements share memory: kept as it is
    leaf = torch.randn(50, requires_grad=True)
    for s in input_sets(Sample((leaf,), {}, "grad"), l2_bytes=64_000, gen=gen)[1:]:
        assert s.args[0].is_leaf and s.args[0].requires_grad


def test_every_side_shares_one_rotation_of_the_input_sets():
    # A side that read the sets another side had just read would find them in cache.
    sets = [Sample((torch.full((4,), float(k)),), {}, "set") for k in range(5)]
    read: list[tuple[str, int]] = []

    def side(name):
        return lambda x: read.append((name, int(x[0])))

    timer = bench.Timer(torch.device("cpu"))
    bench.time_interleaved({"a": (side("a"), sets), "b": (side("b"), sets)}, timer, budget_s=0.02, graph=False)
    timed = [k for _, k in read[6:]]  # after the warm-ups (3 calls a side)
    assert {n for n, _ in read[6:]} == {"a", "b"}
    assert all((k1 - k0) % len(sets) == 1 for k0, k1 in itertools.pairwise(timed)), timed


# Outputs per streaming (elementwise) operator: each tensor is read or written once.
_STREAMING_OUTPUTS = {"add": 1, "add_out": 1, "square": 1, "axpby": 1, "axpby_backward": 2, "sigmoid": 1, "sigmoid_backward": 1}


@pytest.mark.parametrize("spec", [s for s in all_specs() if s.name in _STREAMING_OUTPUTS], ids=lambda s: s.name)
def test_cost_models_count_each_tensor_once(spec):
    gen = generator(torch.device("cpu"), 0)
    sample = next(iter(spec.bench_cases(torch.device("cpu"), torch.float16, gen)))
    cost = spec.cost(*sample.args, **sample.kwargs)
    n = sample.args[0].numel()
    out_tensors = _STREAMING_OUTPUTS[spec.name]
    in_tensors = sum(isinstance(a, torch.Tensor) for a in sample.args) - (1 if spec.mutated_args else 0)
    assert cost.bytes == 2 * n * (in_tensors + out_tensors)
    assert cost.flops >= n


def test_ceilings_are_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path))
    calls = []
    real = ceilings.measure

    def counting(device, name, *, busy=None):
        calls.append(name)
        return real(device, name, busy=busy)

    monkeypatch.setattr(ceilings, "measure", counting)
    first = ceilings.load_or_measure(torch.device("cpu"), "Test CPU")
    again = ceilings.load_or_measure(torch.device("cpu"), "Test CPU")
    assert calls == ["Test CPU"] and again == first
    assert first.copy_gbps > 0 and first.matmul_tflops["float32"] > 0
    assert json.loads(ceilings.cache_path("Test CPU").read_text())["device_name"] == "Test CPU"
    ceilings.load_or_measure(torch.device("cpu"), "Test CPU", remeasure=True)
    assert len(calls) == 2


def test_roofline_floor():
    c = ceilings.Ceilings("x", "t", "d", copy_gbps=1000.0, matmul_tflops={"float32": 50.0, "bfloat16": 800.0})
    assert c.floor_us(1_000_000, 0, "float32") == pytest.approx(1.0)  # 1 MB at 1 TB/s
    assert c.floor_us(0, 50_000_000, "float32") == pytest.approx(1.0)  # 50 MFLOP at 50 TFLOP/s
    assert c.floor_us(1_000_000, 8_000_000_000, "bfloat16") == pytest.approx(10.0)


def _report(times: dict[str, tuple[float, float, float]]) -> BenchReport:
    rep = BenchReport("cuda", "GPU", "1.0", "2.x", "13.0", 1, "abc", "2026-11-22T00:00:00+00:00")
    for case, (p25, med, p75) in times.items():
        timings = {"opforge": Timing(med, p25, p75, 100, "stable"), "eager": Timing(2 * med, 2 * p25, 2 * p75, 100, "stable")}
        rep.rows.append(
            BenchRow("add", "float32", case, "ok", numel=1 << 20, bytes=12 << 20, flops=1 << 20, timings=timings, floor_us=med / 2)
        )
    return rep


def test_compare_flags_only_changes_beyond_the_spread():
    old = _report({"a": (9.0, 10.0, 11.0), "b": (9.0, 10.0, 11.0), "c": (9.0, 10.0, 11.0)})
    new = _report({"a": (10.5, 11.5, 12.5), "b": (11.5, 12.0, 12.5), "c": (7.0, 8.0, 8.5)})
    verdicts = {c.case: c.verdict for c in compare(old, new)}
    assert verdicts == {"a": "same", "b": "regression", "c": "faster"}
    assert compare(old, new)[1].ratio == pytest.approx(1.2)


def test_json_round_trip_csv_and_plot(tmp_path):
    rep = _report({"2^20": (9.0, 10.0, 11.0), "2^22": (39.0, 40.0, 41.0)})
    rep.rows[1].numel = 1 << 22
    rep.rows.append(BenchRow("add", "float16", "2^20", "refused: wrong at this size (x)"))
    rep.rows[0].notes["compiled"] = "RuntimeError: no"
    rep.ceilings = {"copy_gbps": 4000.0, "matmul_tflops": {"float32": 50.0}}
    bench.write_json(rep, tmp_path / "r.json")
    back = bench.read_json(tmp_path / "r.json")
    assert back.rows[0].timings["opforge"] == rep.rows[0].timings["opforge"] and back.rows[2].status.startswith("refused")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["rows"][0]["derived"]["opforge"]["pct_of_limit"] == pytest.approx(50.0)
    assert data["rows"][0]["derived"]["eager"]["speedup_of_opforge"] == pytest.approx(2.0)
    bench.write_csv(rep, tmp_path / "r.csv")
    lines = (tmp_path / "r.csv").read_text().splitlines()
    assert lines[0].startswith("# GPU, driver 1.0") and len(lines) == 2 + 2 + 2 + 1
    bench.plot(rep, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("load", "cores", "threads", "busy"),
    [
        (0.2, 2, 2, None),  # idle: the load is the bench's own process
        (0.9, 2, 2, None),
        (3.6, 2, 2, "the machine is busy: load average 3.6 over the last minute on 2 usable cores"),  # two other jobs
        (2.5, 16, 8, None),  # others run on cores the bench leaves free
        (12.0, 16, 8, "the machine is busy: load average 12.0"),
        (0.0, 2, 4, "torch runs 4 threads on 2 usable cores"),
    ],
)
def test_busy_machine(load, cores, threads, busy):
    found = bench.busy_machine(load, cores, threads)
    assert found is None if busy is None else found is not None and found.startswith(busy), found


def test_busy_cpu_is_a_warning_in_the_report_and_its_json(monkeypatch, tmp_path, capsys):
    import os

    from opforge import cli

    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    report = bench.new_report(torch.device("cpu"))
    [warning] = report.warnings
    assert warning.startswith("the machine is busy: load average 64.0 over the last minute on ")
    bench.write_json(report, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["warnings"] == [warning]
    assert bench.read_json(tmp_path / "r.json").warnings == [warning]
    args = ["bench", "square", "--device", "cpu", "--dtype", "float32", "--budget", "0.01", "--seed", "1", "--no-compile", "--case", "2^16"]
    assert cli.main(args) == 0
    out = capsys.readouterr()
    assert "warning: the machine is busy: load average 64.0" in out.err and "warning: the machine is busy" in out.out
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert bench.new_report(torch.device("cpu")).warnings == [] or torch.get_num_threads() > len(os.sched_getaffinity(0))


def test_lltm_cost_counts_the_gate_matmul_and_each_tensor_once():
    spec = {s.name: s for s in all_specs()}["lltm_forward"]
    B, F, S = 5, 7, 11
    x, h, c = torch.randn(B, F), torch.randn(B, S), torch.randn(B, S)
    w, b = torch.randn(3 * S, F + S), torch.randn(3 * S)
    cost = spec.cost(x, w, b, h, c)
    assert cost.flops == 2 * B * (F + S) * 3 * S
    # inputs once, then new_h, new_cell ([B, S] each) and gates ([B, 3S]) written once
    assert cost.bytes == 4 * (x.numel() + w.numel() + b.numel() + h.numel() + c.numel() + 5 * B * S)


# --- measurements a user would not believe: ceilings measured on a busy machine, outliers, a limit passed ---
# The timings are injected (a fake clock, a stubbed measure, a stubbed time_interleaved): these tests
# do not depend on how loaded the machine running them is.


def _ceil(copy: float, tflops: float = 0.1, *, busy: str | None = None, date: str = "2026-11-20T10:00:00+00:00") -> ceilings.Ceilings:
    return ceilings.Ceilings("Test CPU", torch.__version__, date, copy_gbps=copy, matmul_tflops={"float32": tflops}, busy=busy)


def _t(median: float, spread: float = 0.01) -> Timing:
    return Timing(median, median * (1 - spread / 2), median * (1 + spread / 2), 100, "stable")


def test_a_ceiling_is_the_fastest_of_its_repetitions():
    # One copy held up by other work must not lower the ceiling: durations 3, 1, 2 (and the warm-up).
    ticks = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])
    assert ceilings._best_seconds(lambda: None, torch.device("cpu"), reps=3, clock=lambda: next(ticks)) == 1.0


def test_ceilings_measured_on_a_busy_machine_are_measured_again_when_it_is_idle(tmp_path, monkeypatch):
    monkeypatch.setattr(ceilings, "cache_root", lambda: tmp_path)
    results = iter([_ceil(10.0, 0.05), _ceil(30.0, 0.04, date="2026-11-21T10:00:00+00:00")])
    calls = []

    def measure(device, name, *, busy=None):
        calls.append(busy)
        c = next(results)
        c.busy = busy
        return c

    monkeypatch.setattr(ceilings, "measure", measure)
    said = []
    cpu = torch.device("cpu")
    first = ceilings.load_or_measure(cpu, "Test CPU", busy="load 4.0 on 2 cores", say=said.append)
    assert first.busy == "load 4.0 on 2 cores" and json.loads(ceilings.cache_path("Test CPU").read_text())["busy"] == first.busy
    assert ceilings.load_or_measure(cpu, "Test CPU", busy="load 3.0 on 2 cores") == first  # still busy: the cache stands
    again = ceilings.load_or_measure(cpu, "Test CPU", busy=None, say=said.append)  # idle now: measured again
    assert calls == ["load 4.0 on 2 cores", None]
    assert again.copy_gbps == 30.0 and again.matmul_tflops == {"float32": 0.05} and again.busy is None  # each figure the higher
    assert said == ["the cached ceilings were measured on a busy machine (load 4.0 on 2 cores); measured again: copy 10 -> 30 GB/s"]
    assert ceilings.load_or_measure(cpu, "Test CPU") == again and len(calls) == 2


def _floored(nbytes: int, flops: int = 0) -> BenchRow:
    return BenchRow("op", "float32", "case", "ok", bytes=nbytes, flops=flops)


def test_a_ceiling_that_a_result_beats_is_measured_again_once_and_raised():
    measured, saved, said = [], [], []

    def measure_again():
        measured.append(1)
        return _ceil(40.0, 0.101, date="2026-11-26T16:00:00+00:00")  # matmul within the scatter: not a rise

    roof = ceilings.Roofline(_ceil(20.0, busy="load 3.1 on 2 cores"), measure_again=measure_again, save=saved.append, say=said.append)
    rows = [_floored(2_000_000), _floored(4_000_000)]
    for r in rows:
        roof.floor(r)
    assert [r.floor_us for r in rows] == pytest.approx([100.0, 200.0])  # at 20 GB/s
    assert roof.beaten("op float32 case (opforge, 139 % of limit)")
    assert [r.floor_us for r in rows] == pytest.approx([50.0, 100.0])  # every row floored again, at 40 GB/s
    assert saved == [roof.ceilings] and roof.ceilings.copy_gbps == 40.0 and roof.ceilings.matmul_tflops == {"float32": 0.1}
    assert (
        roof.news
        == said
        == [
            "op float32 case (opforge, 139 % of limit) beat the cached ceilings (measured 2026-11-20 10:00 UTC while load 3.1 on 2 cores): "
            "measured again, copy 20 -> 40 GB/s; the cache now holds the higher figures"
        ]
    )
    assert not roof.beaten("again") and measured == [1]  # once a run

    # Measured again and no higher: the cache is left as it is, and the run says so on its progress stream only.
    said.clear()
    steady = ceilings.Roofline(_ceil(40.0), measure_again=lambda: _ceil(39.0), save=saved.append, say=said.append)
    assert not steady.beaten("op float32 case (eager, 104 % of limit)")
    assert steady.ceilings.copy_gbps == 40.0 and len(saved) == 1 and steady.news == [] and steady.remeasured
    assert said == ["op float32 case (eager, 104 % of limit) beat the machine's ceilings: measured again, none higher (copy 40 GB/s)"]


def test_a_limit_past_what_the_machine_allows_is_said_why():
    roof = ceilings.Roofline(_ceil(20.0, 0.1))
    row = _floored(2_000_000)
    roof.floor(row)  # 100 us at 20 GB/s
    assert roof.beyond(row, "opforge", 70.0) is None  # 143 %: within what a kernel can gain over a copy
    why = roof.beyond(row, "opforge", 50.0)
    assert why.startswith("opforge at 200 % of limit moved its 2 MB faster than the 20 GB/s this machine's copy reached")
    assert "its inputs came from cache" in why
    matmul = BenchRow("op", "float16", "case", "ok", bytes=1000, flops=10**9)  # no float16 rate measured: float32's
    roof.floor(matmul)
    why = roof.beyond(matmul, "opforge", 1000.0)  # 1 GFLOP in 1 ms: 1 TFLOP/s, 10x the measured 0.1
    assert why.startswith("opforge at 1,000 % of limit did its 1 GFLOP faster than the 0.1 TFLOP/s this machine's float32 matmul")
    assert "computes in another type" in why
    busy = ceilings.Roofline(_ceil(20.0, busy="load 3.1 on 2 cores"))
    busy.floor(row)
    assert "measured while the machine was busy, are low" in busy.beyond(row, "opforge", 50.0)


def _mul_spec():
    import opforge

    spec = opforge.spec(torch.ops.aten.mul.Tensor, reference=lambda a, b: a * b)
    spec.function = torch.ops.aten.mul.Tensor  # what registering it would time, without registering it in this process
    return spec


def _scripted_timings(monkeypatch, *script: dict[str, Timing]) -> list[list[str]]:
    """bench.time_interleaved replaced: its n-th call returns script[n] for the sides it is given."""
    calls: list[list[str]] = []

    def fake(sides, timer, *, budget_s, graph):
        calls.append(list(sides))
        return {name: script[len(calls) - 1][name] for name in sides}

    monkeypatch.setattr(bench, "time_interleaved", fake)
    return calls


def _bench_mul(roof, monkeypatch, *script):
    calls = _scripted_timings(monkeypatch, *script)
    [row] = bench.bench_op(
        _mul_spec(), torch.device("cpu"), seed=1, dtypes=[torch.float32], only=["2^16"], compile=False, verify=False, ceilings=roof
    )
    return row, calls


def _rendered(table) -> str:
    from rich.console import Console

    console = Console(record=True, width=400)
    console.print(table)
    return console.export_text()


def test_a_baseline_far_slower_than_its_cost_model_is_timed_again_and_the_steadier_kept(monkeypatch):
    # 2^16 float32 a * b moves 786 KB: 36 us at 22 GB/s. An 8 ms eager call is a time slice, not the kernel.
    row, calls = _bench_mul(_ceil(22.0), monkeypatch, {"opforge": _t(48.0), "eager": _t(8000.0)}, {"eager": _t(41.0)})
    assert calls == [["opforge", "eager"], ["eager"]]  # the outlier alone timed again
    assert row.median("eager") == 41.0 and row.speedup("eager") == pytest.approx(41 / 48)
    assert row.outliers == {} and row.beyond_limit == {}


def test_an_outlier_that_stays_is_marked_with_its_reason_in_both_tables(monkeypatch):
    from opforge.cli.report import SummaryOp, bench_table, summary_table

    row, calls = _bench_mul(_ceil(22.0), monkeypatch, {"opforge": _t(48.0), "eager": _t(8000.0)}, {"eager": _t(7990.0)})
    assert len(calls) == 2 and row.median("eager") == 7990.0  # the faster of two outliers
    assert list(row.outliers) == ["eager"]
    assert row.outliers["eager"].startswith("eager in both of two timings: 7,990 us is 224x the 35.7 us its cost model needs")
    report = BenchReport("cpu", "Test CPU", None, "2.x", None, 2, None, "2026-11-26T00:00:00+00:00", rows=[row])
    for text in (_rendered(bench_table(report)), _rendered(summary_table(report, [SummaryOp("aten::mul", [], [row])]))):
        assert "166.46x (1)" in text, text
        assert "(1) mul float32 2^16, eager in both of two timings: 7,990 us is 224x" in text
    # A spread past half the median is an outlier too, whatever the cost model.
    row, calls = _bench_mul(_ceil(22.0), monkeypatch, {"opforge": _t(48.0, spread=0.9), "eager": _t(40.0)}, {"opforge": _t(47.0)})
    assert calls == [["opforge", "eager"], ["opforge"]] and row.median("opforge") == 47.0 and row.outliers == {}


def test_a_result_that_beats_the_ceilings_has_them_measured_again_and_an_impossible_limit_is_marked(monkeypatch):
    from opforge.cli.report import bench_table, row_line

    measured = []

    def measure_again():
        measured.append(1)
        return _ceil(30.0)  # higher than the cached 10 GB/s, and still beaten below

    saved = []
    roof = ceilings.Roofline(_ceil(10.0), measure_again=measure_again, save=saved.append)
    # The copy a busy machine measured: 786 KB take 79 us at 10 GB/s; opforge took 20, 26 us at 30 GB/s.
    row, _ = _bench_mul(roof, monkeypatch, {"opforge": _t(20.0), "eager": _t(21.0)})
    assert measured == [1] and saved == [roof.ceilings] and row.floor_us == pytest.approx(786_432 / 30e3)
    assert row.pct_of_limit("opforge") == pytest.approx(131, abs=1)  # within the margin: shown as it is
    assert row.beyond_limit == {} and len(roof.news) == 1 and "copy 10 -> 30 GB/s" in roof.news[0]
    row, _ = _bench_mul(roof, monkeypatch, {"opforge": _t(10.0), "eager": _t(21.0)})
    assert measured == [1]  # once a run
    assert list(row.beyond_limit) == ["opforge"] and row.beyond_limit["opforge"].startswith("opforge at 262 % of limit moved its 786 KB")
    report = BenchReport("cpu", "Test CPU", None, "2.x", None, 2, None, "2026-11-26T00:00:00+00:00", rows=[row])
    text = _rendered(bench_table(report))
    assert "262% (1)" in text and "(1) mul float32 2^16, opforge at 262 % of limit" in text
    assert "not to be taken as it stands: % of limit" in row_line(row, 1.0)


def test_the_cli_says_when_a_beaten_ceiling_is_raised_and_keeps_the_higher_one(tmp_path, monkeypatch, capsys):
    from opforge import cli

    monkeypatch.setattr(ceilings, "cache_root", lambda: tmp_path)
    name = bench.device_name(torch.device("cpu"))
    ceilings.save(ceilings.Ceilings(name, torch.__version__, "2026-11-20T10:00:00+00:00", 5.0, {"float32": 0.02}, busy="load 4.0"))
    higher = ceilings.Ceilings(name, torch.__version__, "2026-11-26T16:00:00+00:00", 30.0, {"float32": 0.2})
    monkeypatch.setattr(ceilings, "measure", lambda device, n, *, busy=None: higher)
    _scripted_timings(monkeypatch, {"opforge": _t(30.0), "eager": _t(31.0)})
    monkeypatch.setattr(bench, "cpu_contention", lambda: "load 4.0")  # still busy: the cache is not measured again up front
    spec_file = tmp_path / "mul_spec.py"
    spec_file.write_text("import torch\nimport opforge\nSPECS = [opforge.spec(torch.ops.aten.mul.Tensor, reference=lambda a, b: a * b)]\n")
    args = ["bench", str(spec_file), "--device", "cpu", "--dtype", "float32", "--case", "2^16", "--no-compile", "--seed", "1",
            "--json", str(tmp_path / "r.json")]  # fmt: skip
    assert cli.main(args) == 0
    out = capsys.readouterr()
    news = "mul float32 2^16 (opforge, 524 % of limit) beat the cached ceilings (measured 2026-11-20 10:00 UTC while load 4.0)"
    assert news in out.err and news in out.out
    cached = json.loads(ceilings.cache_path(name).read_text())
    assert cached["copy_gbps"] == 30.0 and cached["matmul_tflops"] == {"float32": 0.2}
    report = bench.read_json(tmp_path / "r.json")
    assert report.ceilings["copy_gbps"] == 30.0 and report.notes and report.notes[0].startswith(news)
    assert report.rows[0].pct_of_limit("opforge") == pytest.approx(87, abs=1)  # 26 us at 30 GB/s over 30 us


@pytest.mark.cuda
def test_on_a_gpu_a_ceiling_that_a_result_beats_is_measured_again_and_raised(tmp_path, monkeypatch):
    # The same path as the CPU's, with the GPU's own measure (CUDA events, 1 GiB copy, 8192^3 matmuls):
    # a cached copy ceiling of 1 GB/s is beaten by any kernel, measured again and raised.
    from opforge.registry import get_specs

    monkeypatch.setattr(ceilings, "cache_root", lambda: tmp_path)
    cuda = torch.device("cuda")
    name = bench.device_name(cuda)
    low = ceilings.Ceilings(name, torch.__version__, "2026-11-20T10:00:00+00:00", 1.0, {"float32": 0.1, "float16": 0.1, "bfloat16": 0.1})
    ceilings.save(low)
    said: list[str] = []
    roof = ceilings.roofline(cuda, name, say=said.append)
    assert roof.ceilings == low  # cached, not busy: used as it is until beaten
    (square,) = get_specs(["square"])
    [row] = bench.bench_op(square, cuda, seed=1, dtypes=[torch.float32], only=["2^26"], compile=False, verify=False, ceilings=roof)
    assert roof.remeasured and len(roof.news) == 1 and said == roof.news, said
    cached = json.loads(ceilings.cache_path(name).read_text())
    assert cached["copy_gbps"] > 100 and all(v > 1 for v in cached["matmul_tflops"].values())  # any GPU opforge runs on
    assert 10 < row.pct_of_limit("opforge") < 150 and row.beyond_limit == {} and row.outliers == {}, (row.pct_of_limit("opforge"), row)
