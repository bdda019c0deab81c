"""opforge's operators in distributed training, one process per rank (tests/dist_scenarios.py,
started by torchrun): DDP and FSDP2 with opforge.nn.LLTM; a tensor-parallel MLP
(ColwiseParallel Linear -> opforge.sigmoid -> RowwiseParallel Linear), eager and compiled; a
column- then row-parallel pair of QQQLinear. Each equals one device computing the same thing,
output and gradients.

On the CPU: 2 processes over gloo on 127.0.0.1, all scenarios in one torchrun (about 30 s on two
cores). On two GPUs or more (``multigpu``, also ``cuda``): the same over NCCL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import SRC

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("dist_scenarios.py")
SCENARIOS = ("ddp_lltm", "fsdp2_lltm", "tp_mlp_sigmoid", "tp_mlp_sigmoid_compiled", "tp_qqq_pair")

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed"),
    pytest.mark.xdist_group("distributed"),  # one torchrun per device kind, its scenarios read by several tests
]


def torchrun(device: str, out: Path, nproc: int = 2) -> dict[str, str]:
    """All scenarios in one torchrun of ``nproc`` processes; their verdicts (rank 0's results.json)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "1")  # two processes on two cores
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(SCRIPT)]
    res = subprocess.run([*cmd, "--device", device, "--out", str(out)], env=env, capture_output=True, text=True, timeout=1200)
    found = out / "results.json"
    if res.returncode != 0 or not found.is_file():
        pytest.fail(f"torchrun exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
    return json.loads(found.read_text())


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory) -> dict[str, str]:
    return torchrun("cpu", tmp_path_factory.mktemp("dist-cpu"))


@pytest.fixture(scope="module")
def gpu_results(tmp_path_factory) -> dict[str, str]:
    return torchrun("cuda", tmp_path_factory.mktemp("dist-gpu"))


@pytest.mark.parametrize("name", SCENARIOS)
def test_on_two_cpu_processes_over_gloo(cpu_results, name):
    assert cpu_results[name] == "ok", cpu_results[name]


@pytest.mark.cuda
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs two GPUs, {torch.cuda.device_count()} visible")
@pytest.mark.parametrize("name", SCENARIOS)
def test_on_two_gpus_over_nccl(gpu_results, name):
    assert gpu_results[name] == "ok", gpu_results[name]


def test_the_tensor_parallel_w4a8_benchmark_runs(tmp_path):
    # A smoke run of benchmarks/tp_qqq.py over gloo, tiny sizes: the GPU run must not be its first.
    env = {**os.environ, "PYTHONPATH": SRC, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "benchmarks" / "tp_qqq.py")]
    args = [
        "--device",
        "cpu",
        "--dim",
        "256",
        "--hidden",
        "512",
        "--decode-m",
        "1",
        "3",
        "--prefill-m",
        "64",
        "--warmup",
        "1",
        "--reps",
        "3",
    ]
    res = subprocess.run([*cmd, *args, "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    (found,) = tmp_path.glob("tp-qqq_*-x2_*.json")
    report = json.loads(found.read_text())
    assert [(r["M"], r["group_size"]) for r in report["rows"]] == [(m, g) for g in (-1, 128) for m in (1, 3, 64)]
    assert all(r["w4a8_1gpu_us"] > 0 and r["w4a8_tp_us"] > 0 for r in report["rows"])
