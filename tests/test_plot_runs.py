"""scripts/plot_runs.py: several runs' curves side by side, read from their metrics.jsonl alone."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import is_png

from conftest import REPO, clean_env

import common.curves as curves

SCRIPT = REPO / "scripts" / "plot_runs.py"


def write_run(folder: Path, losses: list[float], best_step: int | None = None) -> Path:
    folder.mkdir(parents=True)
    lines = [{"step": step, "time": 0.1 * step, "train/loss": loss, "lr": 0.001} for step, loss in enumerate(losses, 1)]
    lines.append({"step": len(losses), "val/accuracy": 0.5})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if best_step is not None:
        (folder / "checkpoints" / f"best_step_{best_step:08d}").mkdir(parents=True)
        (folder / "checkpoints" / f"best_step_{best_step:08d}" / "progress.json").write_text("{}")
    return folder


def load_script():
    spec = importlib.util.spec_from_file_location("plot_runs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_runs_are_drawn_in_the_same_panels_one_line_each_labelled_by_folder(tmp_path, monkeypatch, capsys):
    a = write_run(tmp_path / "runs" / "a", [3.0, 2.0, 1.0], best_step=2)
    b = write_run(tmp_path / "runs" / "b", [4.0, 3.5])
    figures = []
    real = curves.curves_figure
    module = load_script()
    monkeypatch.setattr(module, "curves_figure", lambda *args, **kwargs: figures.append(real(*args, **kwargs))
                        or figures[-1])
    output = tmp_path / "both.png"
    assert module.main([str(a), str(b), "-o", str(output)]) == output
    assert is_png(output) and capsys.readouterr().out == f"wrote {output}\n"
    (figure,) = figures
    loss = next(ax for ax in figure.axes if ax.get_title() == "loss")
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in loss.get_lines()}
    assert lines[str(a)] == ([1, 2, 3], [3.0, 2.0, 1.0]) and lines[str(b)] == ([1, 2], [4.0, 3.5])
    assert lines[f"best checkpoint of {a} (step 2)"][0] == [2, 2]  # only a has a best checkpoint
    assert len(lines) == 3
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert titles == ["loss", "learning rate"]  # val/accuracy is the same in both runs: no panel


def test_the_script_needs_no_torch_and_writes_one_runs_picture_into_its_folder(tmp_path):
    run = write_run(tmp_path / "run", [2.0, 1.0])
    code = (f"import runpy, sys; sys.argv = [{str(SCRIPT)!r}, sys.argv[1]]; "
            "runpy.run_path(sys.argv[0], run_name='__main__'); "
            "print(sorted(m for m in ('torch', 'accelerate') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(run)], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"wrote {run / 'curves.png'}", "[]"]
    assert is_png(run / "curves.png")


@pytest.mark.parametrize("make_bad", ["missing", "no_metrics"])
def test_a_folder_without_metrics_jsonl_is_one_error_line_exit_2_and_nothing_written(tmp_path, make_bad):
    good = write_run(tmp_path / "good", [1.0])
    bad = tmp_path / "bad"
    if make_bad == "no_metrics":
        bad.mkdir()
    done = subprocess.run([sys.executable, str(SCRIPT), str(good), str(bad), "-o", str(tmp_path / "out.png")],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"error: {bad}: no metrics.jsonl here; give run folders (a template's "
                                        "--output_dir)"], done.stderr
    assert done.stdout == "" and not (tmp_path / "out.png").exists() and not (good / "curves.png").exists()
