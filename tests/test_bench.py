"""bench/ scripts in their tiny modes, so they keep working as the templates change: each one runs
the real templates end to end and prints its table. No timing is asserted (these are not benchmarks)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, clean_env

SCRIPTS = ["overhead", "data_loading", "checkpoints", "scaling", "gpu", "finetune_loading"]


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    assert "usage:" in run(f"bench/{script}.py", "--help").stdout


def test_overhead_quick():
    out = run("bench/overhead.py", "--quick", "--attribution-repeats", "1").stdout
    assert "against the plain loop" in out and "template, tracker none" in out
    # Template and plain loop compute the same thing: the losses they log agree exactly.
    for line in out.splitlines():
        if line.startswith("| image_classification ") or line.startswith("| language_model "):
            if "max diff" in line:
                assert "max diff 0e+00" in line, line
    assert "is_lomo_available" in out  # the attribution ran


def test_data_loading_quick():
    out = run("bench/data_loading.py", "--quick").stdout
    for case in ("image, digits (default)", "image, PNG folder", "language, stdlib (default)", "language, token files"):
        assert f"| {case}" in out, case


def test_checkpoints_quick():
    out = run("bench/checkpoints.py", "--quick").stdout
    assert "| save " in out and "| load " in out and "| bytes on disk" in out


def test_scaling_quick():
    out = run("bench/scaling.py", "--quick").stdout
    assert "Model size" in out and "2 DDP ranks" in out


def test_finetune_loading_quick():
    out = run("bench/finetune_loading.py", "--quick", "--dtype", "fp32").stdout
    rows = [line for line in out.splitlines() if line.startswith("| fp32 ")]
    assert len(rows) == 4 and "one copy" in rows[0] and "naive" in rows[3], out  # 2 ways x 2 ranks measured


def test_gpu_dry_run_builds_the_commands():
    out = run("bench/gpu.py", "--dry-run").stdout.splitlines()
    assert len(out) == 3
    lm = out[0]
    for part in ("single_gpu.yaml", "language_model", "--n_layer 12", "--n_embd 768", "--block_size 1024",
                 "--vocab_size 50304", "--mixed_precision bf16", "--compile true"):
        assert part in lm, part
    assert all("image_classification" in line for line in out[1:])


def test_gpu_smoke_runs_the_same_path_on_cpu():
    out = run("bench/gpu.py", "--smoke", "--no-compile", "--tracker", "none").stdout
    assert "language model (smoke: tiny)" in out and "image, digits, batch 64" in out and "FAILED" not in out


def test_write_results_replaces_only_its_section(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "bench"))
    import harness

    monkeypatch.setattr(harness, "RESULTS", tmp_path / "RESULTS.md")
    info = {"cores": 2, "cpu": "x", "gpu": None, "torch": "t", "accelerate": "a", "python": "p", "load": 0.0,
            "threads": 1}
    harness.write_results("one", "One", "first", info)
    harness.write_results("two", "Two", "second", info)
    harness.write_results("one", "One", "third", info)
    text = (tmp_path / "RESULTS.md").read_text()
    assert "third" in text and "second" in text and "first" not in text
    assert text.index("## One") < text.index("## Two")
