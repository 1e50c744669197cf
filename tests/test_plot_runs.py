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


def test_runs_compare_against_the_images_they_trained_on_and_the_axis_says_which(tmp_path, monkeypatch, capsys):
    """A 2-process run trains on twice the images a step: against the step it looks as if it learned faster; against
    the images seen (`images_per_step`, logged with every training loss) the two line up."""
    one, two = tmp_path / "one_process", tmp_path / "two_processes"
    for folder, per_step in ((one, 64.0), (two, 128.0)):
        folder.mkdir()
        records = [{"step": step, "train/loss": 4.0 / (step * per_step), "lr": 0.001, "images_per_step": per_step}
                   for step in (10, 20, 30)] + [{"step": 30, "val/loss": 1.0}]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    figures = []
    real = curves.curves_figure
    module = load_script()
    monkeypatch.setattr(module, "curves_figure", lambda *args, **kwargs: figures.append(real(*args, **kwargs))
                        or figures[-1])
    for x in ("step", "images"):
        module.main([str(one), str(two), "--x", x, "-o", str(tmp_path / f"{x}.png")])
    by_step, by_images = figures
    assert {ax.get_xlabel() for ax in by_step.axes if ax.get_title()} == {"optimizer step"}
    assert {ax.get_xlabel() for ax in by_images.axes if ax.get_title()} == {"images seen (all processes)"}
    loss = next(ax for ax in by_images.axes if ax.get_title() == "loss")
    lines = {line.get_label(): list(line.get_xdata()) for line in loss.get_lines()}
    assert lines[f"{one} train/loss"] == [640, 1280, 1920] and lines[f"{two} train/loss"] == [1280, 2560, 3840]
    assert lines[f"{two} val/loss"] == [3840]
    plain = write_run(tmp_path / "older", [3.0, 2.0])  # no images_per_step: a run of an older version
    result = subprocess.run([sys.executable, str(SCRIPT), str(one), str(plain), "--x", "images"], env=clean_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: --x images: {plain} logged no images_per_step (another template's unit, or a run of an older "
        "version): plot against --x step"]


@pytest.mark.parametrize("several", [False, True])
def test_every_legend_stands_beside_its_panel_and_covers_no_curve(tmp_path, several):
    """The legend's box, as drawn, overlaps no panel's (its own curves, nor the next panel's), and stays in the
    picture: with one run, and with several whose long folder names make long labels."""
    names = ["runs/a_long_folder_name_of_a_run/lr_0.001", "runs/b_long_folder_name_of_a_run/lr_0.002"]
    runs = {}
    for r, name in enumerate(names[: 1 + several]):
        records = [{"step": s, "train/loss": 3.0 / s + r, "lr": 0.001, "images_per_s": 100.0 + s} for s in range(1, 40)]
        records += [{"step": s, "val/loss": 3.2 / s + r, "val/accuracy": s / 40 + r / 10} for s in range(5, 40, 5)]
        runs[name] = curves.metric_series(records)
    figure = curves.curves_figure(runs, {names[0]: 20}, title="compare")
    figure.canvas.draw()
    panels = [ax for ax in figure.axes if ax.get_title()]
    legends = [ax.get_legend() for ax in panels if ax.get_legend() is not None]
    assert len(legends) >= 2
    picture = figure.bbox
    for legend in legends:
        box = legend.get_window_extent()
        assert not any(box.overlaps(ax.get_window_extent()) for ax in panels), box
        assert picture.x0 <= box.x0 and box.x1 <= picture.x1 and picture.y0 <= box.y0 and box.y1 <= picture.y1
