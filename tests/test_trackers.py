"""--tracker through accelerate's trackers: what each one wrote, read back with its own reader (TensorBoard's
EventAccumulator, MLflow's client on the local store in the output folder, trackio's SQLiteStorage on its store in
the output folder), holds every step of metrics.jsonl once, on one process and on two ranks (the main process alone
writes), also after a resume from a checkpoint older than the last step logged, and every step logged before a
terminal's Ctrl-C; a template with `--tracker tensorboard,mlflow,trackio` runs without wandb importable, and a
missing tracker package is one error line before anything is written.

W&B's own behaviour (offline, resume id, sweeps, Ctrl-C) is tested in test_tracking.py, test_sweeps.py and
test_bad_input.py.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CTRL_C_LINE, REPO, accelerate_launch_command, clean_env, interrupt_like_ctrl_c, launch

LM = REPO / "templates" / "language_model.py"
TRACKERS = "tensorboard,mlflow,trackio"
PROJECT = "tiny-lm"  # --wandb_project: the MLflow experiment and the trackio project too
PROGRESS_BAR = re.compile(r"^train:\s+\d+%\|")


def tiny_lm(corpus: Path, output: Path, *more: str) -> list[str]:
    """A few steps of a tiny language model: a log line every step, an evaluation and a checkpoint every 2."""
    return ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--batch_size", "8",
            "--max_steps", "4", "--eval_every_steps", "2", "--eval_batches", "1", "--sample_tokens", "0",
            "--log_every_steps", "1", "--num_workers", "0", "--data_path", str(corpus), "--tracker", TRACKERS,
            "--wandb_project", PROJECT, "--output_dir", str(output), *more]


def without(packages: tuple[str, ...], script: Path, args: list[str]) -> list[str]:
    """`python script args` in an interpreter where `import <package>` fails for each of `packages`, as if it
    were not installed (None in sys.modules: the import raises ImportError, find_spec answers None)."""
    code = (f"import runpy, sys\nfor name in {list(packages)!r}:\n    sys.modules[name] = None\n"
            f"sys.argv = [{str(script)!r}, *{args!r}]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    return [sys.executable, "-c", code]


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)


def logged(output: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as each number's (step, value) pairs in file order: what every tracker must hold."""
    series: dict[str, list[tuple[int, float]]] = {}
    for line in (output / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)) and math.isfinite(value):
                series.setdefault(key, []).append((record["step"], float(value)))
    return series


def tensorboard_scalars(output: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of `<output>/tensorboard` as TensorBoard reads them (its purges of a resumed run applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(output / "tensorboard"), size_guidance={"scalars": 0})
    reader.Reload()
    return {tag: [(event.step, event.value) for event in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def mlflow_metrics(output: Path) -> dict[str, list[tuple[int, float]]]:
    """The one MLflow run in the local store of `output` (the run id file names it), each metric's history."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{output / 'mlflow.db'}")
    runs = client.search_runs([experiment.experiment_id for experiment in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [(output / "mlflow_run_id").read_text().strip()]
    assert client.get_experiment(runs[0].info.experiment_id).name == PROJECT
    return {key: [(m.step, m.value) for m in sorted(client.get_metric_history(runs[0].info.run_id, key),
                                                       key=lambda m: (m.timestamp, m.step))]
            for key in runs[0].data.metrics}


# trackio reads TRACKIO_DIR once, when it is imported: its reader runs in a process of its own for each store
TRACKIO_READER = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage

projects = SQLiteStorage.get_projects()
runs = {project: SQLiteStorage.get_runs(project) for project in projects}
logs = SQLiteStorage.get_logs(projects[0], runs[projects[0]][0]) if len(projects) == 1 else []
print(json.dumps({"runs": runs, "logs": logs}, default=str))
"""


def trackio_metrics(output: Path) -> dict[str, list[tuple[int, float]]]:
    """The one trackio run in the store of `output` (trackio_run_name names it), each metric's (step, value) pairs
    in the order trackio returns its logs, read by trackio's own store reader (SQLiteStorage)."""
    result = subprocess.run([sys.executable, "-c", TRACKIO_READER], cwd=REPO, capture_output=True, text=True,
                            env=clean_env(TRACKIO_DIR=str(output / "trackio")), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    store = json.loads(result.stdout.splitlines()[-1])
    name = (output / "trackio_run_name").read_text().strip()
    assert store["runs"] == {PROJECT: [name]}, store["runs"]  # one project, one run: the main's
    series: dict[str, list[tuple[int, float]]] = {}
    for row in store["logs"]:
        for key, value in row.items():
            if key not in ("step", "timestamp"):
                series.setdefault(key, []).append((row["step"], value))
    return series


def tracker_series(output: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """What each tracker of TRACKERS holds, read back through its own reader."""
    return {"tensorboard": tensorboard_scalars(output), "mlflow": mlflow_metrics(output),
            "trackio": trackio_metrics(output)}


def assert_every_tracker_holds_metrics_jsonl(output: Path, sessions: int) -> None:
    expected = logged(output)
    assert expected["train/loss"] and expected["val/loss"]
    for key, pairs in expected.items():
        steps = [step for step, _ in pairs]
        assert steps == sorted(set(steps)), (key, steps)  # metrics.jsonl itself: each step once
    for name, held in tracker_series(output).items():
        assert set(held) == set(expected), (name, sorted(set(held) ^ set(expected)))
        for key, pairs in expected.items():
            assert [step for step, _ in held[key]] == [step for step, _ in pairs], (name, key, held[key])  # once each
            assert [value for _, value in held[key]] == pytest.approx([value for _, value in pairs], rel=1e-6), key
    # one event file a session, all from the main process (each process that wrote would add its own)
    assert len(list((output / "tensorboard").glob("events.out.tfevents.*"))) == sessions


def test_a_missing_tracker_package_is_one_error_line_before_anything_is_written(tmp_path, corpus):
    output = tmp_path / "run"
    result = run(without(("mlflow",), LM, tiny_lm(corpus, output)))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["error: --tracker mlflow needs the mlflow package, which is not installed: pip install mlflow "
                     "(or choose another --tracker)"], result.stderr[-3000:]
    assert not output.exists()


def test_every_tracker_holds_each_step_once_on_one_process_then_two_ranks_resumed_from_an_older_checkpoint(
    tmp_path, corpus
):
    # One run of each kind keeps the suite short: the first session on one process, a plain `python template.py`
    # where wandb cannot be imported (nothing may ask for it); the second on two ranks, resumed from the checkpoint
    # at step 2 although the first logged steps 3 and 4 too, which it logs again (and goes on to step 6).
    output = tmp_path / "run"
    first = run(without(("wandb",), LM, tiny_lm(corpus, output)))
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert [step for step, _ in logged(output)["train/loss"]] == [1, 2, 3, 4]
    assert_every_tracker_holds_metrics_jsonl(output, sessions=1)
    # The last line says where trackio's store is and how to see it, not trackio's "Uploading logs" (it is local)
    store = output.resolve() / "trackio"
    assert first.stdout.splitlines()[-1] == (f"trackio run saved in {store}; view it with: TRACKIO_DIR={store} "
                                             f"trackio show --project {PROJECT}"), first.stdout[-2000:]
    assert "Uploading logs" not in first.stdout

    resume = ["--resume", str(output / "checkpoints" / "step_00000002"), "--max_steps", "6"]
    second = launch("cpu_ddp.yaml", LM, *tiny_lm(corpus, output, *resume), num_processes=2)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert [step for step, _ in logged(output)["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert_every_tracker_holds_metrics_jsonl(output, sessions=2)  # the main process alone wrote: one file more
    assert second.stdout.splitlines()[-1] == first.stdout.splitlines()[-1], second.stdout[-2000:]
    assert re.fullmatch(r"[0-9a-f]{32}\n", (output / "mlflow_run_id").read_text())


def steps_so_far(output: Path) -> list[int]:
    """The steps of the training losses in metrics.jsonl while the run writes it (a line being written is left out)."""
    steps = []
    for line in (output / "metrics.jsonl").read_text().splitlines() if (output / "metrics.jsonl").is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "train/loss" in record:
            steps.append(record["step"])
    return steps


def test_after_ctrl_c_every_tracker_holds_each_step_logged_before_it_and_the_run_ends_with_the_one_line(
    tmp_path, corpus
):
    """A terminal's Ctrl-C reaches `accelerate launch` and the run alike (one process group); the launcher then
    terminates the run's process tree. The run ends each tracker's run on its way out, so that what a tracker had not
    yet written (trackio's sender writes every half second) is in its store too: each holds every step of
    metrics.jsonl. Stderr ends with the one line, and the exit code is the documented 130."""
    output = tmp_path / "run"

    def ten_steps_logged(child):
        deadline = time.monotonic() + 120
        while len(steps_so_far(output)) < 10 and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.1)
        assert len(steps_so_far(output)) >= 10, "the run logged nothing"

    code, stderr = interrupt_like_ctrl_c(
        accelerate_launch_command("cpu.yaml", LM, *tiny_lm(corpus, output, "--max_steps", "100000")), ten_steps_logged)
    assert code == 130, stderr[-3000:]
    lines = [line for line in re.split(r"[\r\n]+", stderr) if line.strip() and not PROGRESS_BAR.match(line)]
    assert lines == [CTRL_C_LINE], stderr[-3000:]
    final = logged(output)
    last = max(step for pairs in final.values() for step, _ in pairs)
    for name, held in tracker_series(output).items():
        assert set(held) <= set(final), (name, sorted(set(held) - set(final)))
        for key, pairs in final.items():
            got = held.get(key, [])
            # the interrupt may fall between the last step's line in metrics.jsonl and the trackers' calls for it
            want = pairs if len(got) == len(pairs) else [(step, value) for step, value in pairs if step != last]
            assert [step for step, _ in got] == [step for step, _ in want], (name, key, got[-3:], want[-3:])
            assert [value for _, value in got] == pytest.approx([value for _, value in want], rel=1e-6), (name, key)


def test_the_trackers_are_accelerates_own_and_the_accelerator_finds_them_until_they_end(
    tmp_path, fresh_accelerate, monkeypatch
):
    from accelerate.tracking import TensorBoardTracker, WandBTracker
    from test_tracking import FakeWandb

    from common.accelerator import build_accelerator
    from common.tracking import Tracker

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    accelerator = build_accelerator(seed=0)
    tracker = Tracker(accelerator, tmp_path, kind="wandb,tensorboard", project="p", config={"sizes": [1, 2]})
    run = tracker.run
    assert isinstance(accelerator.get_tracker("wandb"), WandBTracker) and accelerator.get_tracker("wandb", True) is run
    assert isinstance(accelerator.get_tracker("tensorboard"), TensorBoardTracker)
    assert fake.inits[0]["config"] == {"sizes": [1, 2]} and fake.inits[0]["dir"] == str(tmp_path)
    tracker.log({"loss": 0.5, "note": "x"}, step=3)
    tracker.finish()
    assert run.finished and run.logged == [(3, {"loss": 0.5, "note": "x"})]
    assert tensorboard_scalars(tmp_path) == {"loss": [(3, 0.5)]}  # numbers only: text is W&B's and metrics.jsonl's
    assert accelerator.trackers == []  # ended once: accelerator.end_training() does not end them again
    accelerator.end_training()
