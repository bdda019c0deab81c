"""The opforge command, run as users run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import opforge

SRC = str(Path(opforge.__file__).resolve().parent.parent)


def opforge_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "opforge", *args], env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True, timeout=900
    )


def test_check_passes_and_prints_the_table():
    res = opforge_cli("check", "add", "axpby", "--device", "cpu", "--seed", "7")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "opforge::add " in res.stdout and "opforge::axpby " in res.stdout
    for col in ("reference", "opcheck", "gradcheck", "compile", "bad inputs"):
        assert col in res.stdout
    assert res.stdout.strip().endswith("10 passed, 0 failed")
    assert "seed 7" in res.stderr


def test_check_unknown_op_is_a_clear_error():
    res = opforge_cli("check", "no_such_op")
    assert res.returncode != 0
    assert "no operator named 'no_such_op'; known: add, add_out" in res.stderr


def test_check_cuda_without_a_gpu_says_why():
    import torch

    if torch.cuda.is_available():
        return
    res = opforge_cli("check", "add", "--device", "cuda")
    assert res.returncode != 0 and "torch sees no GPU" in res.stderr


def test_bench_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    res = opforge_cli("bench", "square", "--device", "cpu", "--dtype", "float32", "--budget", "0.02", "--json", str(path), "--seed", "3")
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(path.read_text())
    assert data["torch_version"] and data["device"] == "cpu" and data["date"] and data["threads"] >= 1
    rows = data["rows"]
    assert [r["case"] for r in rows] == ["2^16", "2^20", "2^22"]
    for r in rows:
        assert r["status"] == "ok" and r["bytes"] == 8 * r["numel"]
        assert r["opforge"]["median_us"] > 0 and r["torch"]["median_us"] > 0
        assert abs(r["speedup"] - r["torch"]["median_us"] / r["opforge"]["median_us"]) < 1e-9
    assert "opforge bench" in res.stdout and "speedup" in res.stdout


def test_list_and_build():
    res = opforge_cli("list")
    assert res.returncode == 0 and "opforge::axpby(Tensor x, Tensor y, float alpha=3., float beta=-1.) -> Tensor" in res.stdout
    res = opforge_cli("build")
    assert res.returncode == 0 and "op library:" in res.stdout and "(cached;" in res.stdout
