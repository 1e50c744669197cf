"""common.tracking: metrics.jsonl from the main process only, resume-safe; W&B online only with credentials."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import is_png

import common.curves as curves
import common.tracking as tracking
from common.accelerator import build_accelerator
from common.curves import CURVES_FILE, METRICS_FILE, curve_panels, metric_series
from common.errors import UsageError
from common.tracking import Tracker, wandb_has_credentials

MAIN, OTHER_RANK = SimpleNamespace(is_main_process=True), SimpleNamespace(is_main_process=False)


def strict_lines(path: Path) -> list[dict]:
    """Parse metrics.jsonl as strict JSON: NaN/Infinity tokens (not JSON) fail the test."""

    def refuse(token):
        raise AssertionError(f"{token} in {path}: not valid JSON for other readers")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


class FakeWandb(types.ModuleType):
    """Stands in for the wandb package: records init calls, never touches the network or disk."""

    def __init__(self):
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.Settings = lambda **kwargs: SimpleNamespace(**kwargs)

    def init(self, **kwargs):
        self.inits.append(kwargs)
        run_dir = Path(kwargs["dir"]) / "wandb" / "run-x" / "files"
        run = SimpleNamespace(logged=[], summary={}, finished=False, dir=str(run_dir))
        run.log = lambda metrics, step: run.logged.append((step, metrics))
        run.finish = lambda exit_code=None: setattr(run, "finished", True)
        return run


@pytest.fixture
def no_wandb_env(monkeypatch, tmp_path):
    """No credentials anywhere: no WANDB_* variables, and a HOME without ~/.netrc."""
    for key in [k for k in os.environ if k.startswith("WANDB_")] + ["NETRC"]:
        monkeypatch.delenv(key, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    return home


@pytest.fixture
def accelerate_state(fresh_accelerate):
    """accelerate's process state, single-process on the CPU, as every run has (accelerate's trackers log through
    it); forgotten after the test."""
    from accelerate.state import PartialState

    PartialState(cpu=True)


@pytest.fixture
def fake_wandb(monkeypatch, no_wandb_env, accelerate_state):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


# --- metrics.jsonl ------------------------------------------------------------------------------

def test_metrics_written_one_json_line_per_log(tmp_path):
    tracker = Tracker(MAIN, tmp_path / "run", kind="none", project="p", config={})
    tracker.log({"train/loss": 0.5, "lr": 1e-3}, step=1)
    tracker.log({"val/accuracy": 0.75, "val/samples": 100, "note": "x"}, step=2)
    first, second = strict_lines(tmp_path / "run" / METRICS_FILE)
    assert first["step"] == 1 and first["train/loss"] == 0.5 and first["lr"] == 1e-3
    assert isinstance(first["time"], float) and first["time"] >= 0
    assert second["step"] == 2 and second["val/samples"] == 100 and second["note"] == "x"


def test_non_finite_values_are_written_as_null(tmp_path):
    tracker = Tracker(MAIN, tmp_path, kind="none", project="p", config={})
    tracker.log({"loss": math.nan, "up": math.inf, "down": -math.inf, "ok": 1.5}, step=3)
    (record,) = strict_lines(tmp_path / METRICS_FILE)
    assert record["loss"] is None and record["up"] is None and record["down"] is None and record["ok"] == 1.5


def test_only_the_main_process_writes(tmp_path, fake_wandb):
    tracker = Tracker(OTHER_RANK, tmp_path / "run", kind="wandb", project="p", config={})
    tracker.log({"loss": 1.0}, step=1)
    tracker.summary({"best": 1.0})
    tracker.finish()
    assert not (tmp_path / "run").exists()  # not even the folder: the main process owns it
    assert fake_wandb.inits == []  # and no second W&B run


def test_main_process_of_a_real_accelerator_writes(tmp_path, fresh_accelerate):
    accelerator = build_accelerator(seed=0)
    tracker = Tracker(accelerator, tmp_path, kind="none", project="p", config={})
    tracker.log({"loss": 1.0}, step=1)
    assert [r["step"] for r in strict_lines(tmp_path / METRICS_FILE)] == [1]


def write_lines(path: Path, steps, tail: str = "") -> None:
    path.write_text("".join(json.dumps({"step": s, "time": 0.1, "loss": 1.0 / s}) + "\n" for s in steps) + tail)


def test_resume_drops_lines_after_the_resumed_step_and_a_half_written_line(tmp_path):
    path = tmp_path / METRICS_FILE
    write_lines(path, range(1, 7), tail='{"step": 7, "time": 0.1, "lo')  # the crash cut the last line
    tracker = Tracker(MAIN, tmp_path, kind="none", project="p", config={}, resume_step=4)
    assert [r["step"] for r in strict_lines(path)] == [1, 2, 3, 4]
    tracker.log({"loss": 0.1}, step=5)  # the resumed run appends cleanly after the kept lines
    assert [r["step"] for r in strict_lines(path)] == [1, 2, 3, 4, 5]


def test_samples_go_to_their_own_file_on_the_main_process_and_a_resume_drops_the_later_ones(tmp_path, fake_wandb):
    rows = [{"prompt": "reverse ab =", "output": " ba", "expected": " ba"}]
    Tracker(OTHER_RANK, tmp_path, kind="none", project="p", config={}).log_samples(rows, step=2)
    assert not (tmp_path / "samples.jsonl").exists()
    tracker = Tracker(MAIN, tmp_path, kind="none", project="p", config={})
    for step in (2, 4, 6):
        tracker.log_samples(rows * 2, step=step)
    Tracker(MAIN, tmp_path, kind="none", project="p", config={}, resume_step=4)
    lines = strict_lines(tmp_path / "samples.jsonl")
    assert [r["step"] for r in lines] == [2, 2, 4, 4] and lines[0] == {"step": 2, **rows[0]}


def test_fresh_start_in_a_folder_with_old_metrics_keeps_none_of_them(tmp_path):
    path = tmp_path / METRICS_FILE
    write_lines(path, [1, 2, 3])
    Tracker(MAIN, tmp_path, kind="none", project="p", config={}, resume_step=0)
    assert strict_lines(path) == []


# --- curves.png ------------------------------------------------------------------------------------

def log_a_run(tracker: Tracker, steps, scale: float = 1.0) -> None:
    """What a template logs: training lines every step, an evaluation every 4th step (its own line)."""
    for step in steps:
        tracker.log({"train/loss": scale / step, "lr": 0.01 * step, "images_per_s": 100.0 + step,
                     "train/skipped_steps": 0, "epoch": step / 8}, step=step)
        if step % 4 == 0:
            tracker.log({"val/loss": scale / step + 0.1, "val/accuracy": 1 - 1 / step, "val/samples": 359,
                         "epoch": step // 8}, step=step)


def mark_best_checkpoint(output_dir: Path, step: int) -> None:
    """A complete best checkpoint's folder, as CheckpointManager leaves it (only its progress file matters here)."""
    folder = output_dir / "checkpoints" / f"best_step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "progress.json").write_text("{}")


@pytest.fixture(autouse=True)
def curves_on(monkeypatch):
    """The suite runs without pictures (conftest.py); these tests are about them."""
    monkeypatch.setenv("CURVES_PNG", "1")


def test_curves_png_0_in_the_environment_skips_the_picture(tmp_path, monkeypatch, drawn):
    monkeypatch.setenv("CURVES_PNG", "0")
    tracker = Tracker(MAIN, tmp_path, kind="none", project="p", config={})
    log_a_run(tracker, range(1, 5))
    tracker.finish()
    assert drawn == [] and not (tmp_path / CURVES_FILE).exists()


@pytest.fixture
def drawn(monkeypatch) -> list:
    """Every Figure the tracker draws at its end, in order (the real drawing, watched)."""
    figures = []

    def watched(output_dir):
        figures.append(real(output_dir))
        return figures[-1]

    real = tracking.draw_run_curves
    monkeypatch.setattr(tracking, "draw_run_curves", watched)
    return figures


def plotted(figure) -> dict[str, dict[str, tuple[list, list]]]:
    """panel title -> line label -> (x, y), read back from the Figure's own lines."""
    return {ax.get_title(): {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
                             for line in ax.get_lines()} for ax in figure.axes if ax.get_title()}


def test_metric_series_keeps_one_value_a_step_the_last_logged(tmp_path):
    records = [{"step": 1, "time": 0.1, "train/loss": 2.0, "note": "x", "flag": True},
               {"step": 3, "train/loss": 1.0, "val/loss": None},  # a non-finite value, written as null
               {"step": 2, "train/loss": 1.5},
               {"step": 3, "train/loss": 0.5, "epoch": 1}]  # step 3 again (a session that ran past its resume)
    assert metric_series(records) == {"train/loss": ([1, 2, 3], [2.0, 1.5, 0.5])}


def test_panels_group_losses_and_throughputs_and_leave_out_constants():
    series = metric_series([{"step": s, "train/loss": 1 / s, "val/loss": 2 / s, "lr": 0.1, "tokens_per_s": s,
                             "val/accuracy": s / 10, "val/samples": 359, "peak_memory_gb": 0.0} for s in (1, 2)])
    assert curve_panels([series]) == [("loss", ["train/loss", "val/loss"]), ("learning rate", ["lr"]),
                                      ("throughput (per second)", ["tokens_per_s"]), ("val/accuracy", ["val/accuracy"])]


def test_a_finished_run_draws_curves_png_from_metrics_jsonl_with_its_best_checkpoint(tmp_path, drawn):
    tracker = Tracker(MAIN, tmp_path, kind="none", project="p", config={})
    log_a_run(tracker, range(1, 9))
    mark_best_checkpoint(tmp_path, 4)
    tracker.finish()
    picture = tmp_path / CURVES_FILE
    assert is_png(picture)
    (figure,) = drawn
    from PIL import Image

    with Image.open(picture) as image:  # the file is this figure, drawn whole
        assert image.size == tuple(round(inches * 100) for inches in figure.get_size_inches())
    panels = plotted(figure)
    assert list(panels) == ["loss", "learning rate", "throughput (per second)", "val/accuracy"]
    assert panels["loss"]["train/loss"] == (list(range(1, 9)), [1 / s for s in range(1, 9)])
    assert panels["loss"]["val/loss"] == ([4, 8], [1 / 4 + 0.1, 1 / 8 + 0.1])
    assert panels["learning rate"]["lr"] == (list(range(1, 9)), [0.01 * s for s in range(1, 9)])
    assert panels["throughput (per second)"]["images_per_s"][1] == [100.0 + s for s in range(1, 9)]
    assert panels["val/accuracy"]["val/accuracy"] == ([4, 8], [0.75, 0.875])
    assert panels["loss"]["best checkpoint (step 4)"][0] == [4, 4]  # the best checkpoint's step, marked
    assert all(any(x == [4, 4] for x, _ in lines.values()) for lines in panels.values())  # in every panel


def test_a_stopped_then_resumed_run_draws_each_step_once_from_every_session(tmp_path, drawn):
    first = Tracker(MAIN, tmp_path, kind="none", project="p", config={})
    log_a_run(first, range(1, 7))  # logged up to step 6; its last checkpoint was step 4
    first.finish()
    assert is_png(tmp_path / CURVES_FILE) and plotted(drawn[0])["loss"]["train/loss"][0] == list(range(1, 7))
    resumed = Tracker(MAIN, tmp_path, kind="none", project="p", config={}, resume_step=4)
    log_a_run(resumed, range(5, 11), scale=3.0)  # steps 5 and 6 again, with other values
    resumed.finish()
    steps, values = plotted(drawn[1])["loss"]["train/loss"]
    assert steps == list(range(1, 11))
    assert values == [1 / s for s in range(1, 5)] + [3 / s for s in range(5, 11)]
    assert plotted(drawn[1])["loss"]["val/loss"][0] == [4, 8]


def test_without_matplotlib_the_run_ends_normally_and_one_line_says_how_to_get_the_picture(
    tmp_path, monkeypatch, capsys, fake_wandb
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    tracker = Tracker(MAIN, tmp_path, kind="wandb", project="p", config={})
    run = tracker.run
    log_a_run(tracker, range(1, 5))
    tracker.finish()
    assert run.finished and not (tmp_path / CURVES_FILE).exists()
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if CURVES_FILE in line]
    assert lines == [f"{CURVES_FILE} not drawn: matplotlib is not installed; pip install matplotlib, then "
                     f"python scripts/plot_runs.py {tmp_path}"], out
    assert err == ""


def test_a_failure_to_draw_is_one_warning_and_the_run_still_ends(tmp_path, monkeypatch, capsys, fake_wandb):
    def broken(*args, **kwargs):
        raise ValueError("no room for the axes")

    monkeypatch.setattr(curves, "curves_figure", broken)
    tracker = Tracker(MAIN, tmp_path, kind="wandb", project="p", config={})
    run = tracker.run
    log_a_run(tracker, range(1, 5))
    tracker.finish()
    assert run.finished and not (tmp_path / CURVES_FILE).exists()
    err = capsys.readouterr().err
    assert err.splitlines() == [f"warning: {CURVES_FILE} could not be drawn (ValueError: no room for the axes); "
                                f"the values are in {tmp_path / METRICS_FILE}"]


def test_curves_are_drawn_by_the_main_process_only(tmp_path, drawn):
    tracker = Tracker(OTHER_RANK, tmp_path, kind="none", project="p", config={})
    log_a_run(tracker, range(1, 5))
    tracker.finish()
    assert drawn == [] and not (tmp_path / CURVES_FILE).exists()


# --- W&B (faked): when it starts, in which mode, with which run id --------------------------------

def test_tracker_none_starts_no_wandb(tmp_path, fake_wandb):
    tracker = Tracker(MAIN, tmp_path, kind="none", project="p", config={})
    tracker.log({"loss": 1.0}, step=1)
    tracker.finish()
    assert fake_wandb.inits == [] and tracker.run is None


def test_wandb_offline_without_credentials_online_with(tmp_path, fake_wandb, monkeypatch):
    assert Tracker(MAIN, tmp_path / "a", kind="wandb", project="p", config={}).offline is True
    assert fake_wandb.inits[-1]["mode"] == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert Tracker(MAIN, tmp_path / "b", kind="wandb", project="p", config={}).offline is False
    assert fake_wandb.inits[-1]["mode"] == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")  # an explicit mode wins
    Tracker(MAIN, tmp_path / "c", kind="wandb", project="p", config={"lr": 1})
    assert fake_wandb.inits[-1]["mode"] == "disabled"
    assert fake_wandb.inits[-1]["project"] == "p" and fake_wandb.inits[-1]["config"] == {"lr": 1}
    assert fake_wandb.inits[-1]["dir"] == str(tmp_path / "c")


def test_with_wandb_asyncio_logs_no_write_to_a_service_that_is_gone(tmp_path, fake_wandb, caplog, monkeypatch):
    """After a Ctrl-C the launcher ends W&B's service with the run; W&B's client, writing to it through asyncio,
    would log "socket.send() raised exception." after the run's own last line (seen in the Ctrl-C test under load).
    Other asyncio warnings still reach the user."""
    asyncio_log = logging.getLogger("asyncio")
    monkeypatch.setattr(asyncio_log, "filters", list(asyncio_log.filters))  # the process's filters come back after
    Tracker(MAIN, tmp_path, kind="wandb", project="p", config={}).finish()
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        asyncio_log.warning("socket.send() raised exception.")
        asyncio_log.warning("something else")
    assert [record.getMessage() for record in caplog.records if record.name == "asyncio"] == ["something else"]


def test_wandb_run_id_is_kept_for_resume(tmp_path, fake_wandb, monkeypatch):
    Tracker(MAIN, tmp_path, kind="wandb", project="p", config={})
    Tracker(MAIN, tmp_path, kind="wandb", project="p", config={}, resume_step=3)
    first, resumed = fake_wandb.inits
    assert first["id"] == resumed["id"] and resumed["resume"] == "allow"
    assert (tmp_path / "wandb_run_id").read_text().strip() == first["id"]
    assert Tracker(MAIN, tmp_path / "other", kind="wandb", project="p", config={}).run is not None
    assert fake_wandb.inits[-1]["id"] != first["id"]  # a new output folder is a new W&B run
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep1")  # the sweep agent names the run
    Tracker(MAIN, tmp_path / "trial", kind="wandb", project="p", config={})
    assert "id" not in fake_wandb.inits[-1] and "resume" not in fake_wandb.inits[-1]


def test_wandb_receives_the_metrics_and_the_summary(tmp_path, fake_wandb, capsys):
    tracker = Tracker(MAIN, tmp_path, kind="wandb", project="p", config={})
    run = tracker.run
    tracker.log({"loss": math.nan, "acc": 0.5}, step=7)
    tracker.summary({"best": 0.5})
    tracker.finish()
    assert run.logged[0][0] == 7 and run.logged[0][1]["acc"] == 0.5
    assert run.summary == {"best": 0.5} and run.finished
    assert f"wandb sync {tmp_path / 'wandb' / 'run-x'}" in capsys.readouterr().out


def test_online_run_prints_no_sync_hint(tmp_path, fake_wandb, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    tracker = Tracker(MAIN, tmp_path, kind="wandb", project="p", config={})
    tracker.finish()
    assert "wandb sync" not in capsys.readouterr().out


# --- W&B for real, offline (one run) ------------------------------------------------------------

def test_real_wandb_without_credentials_runs_offline_and_keeps_the_key_out_of_files(
    tmp_path, no_wandb_env, accelerate_state, monkeypatch, capsys
):
    import wandb

    secret = "f" * 24 + "0123456789abcdef"  # 40 characters, like a real key
    real_init = wandb.init

    def init_with_a_key_in_the_environment(**kwargs):
        # The mode has been chosen (offline: no credentials); now a key sits in the environment, as
        # it would for a user who sets WANDB_API_KEY and WANDB_MODE=offline.
        monkeypatch.setenv("WANDB_API_KEY", secret)
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", init_with_a_key_in_the_environment)
    monkeypatch.setenv("WANDB_SILENT", "true")
    output = tmp_path / "run"
    tracker = Tracker(MAIN, output, kind="wandb", project="tests", config={"learning_rate": 0.1})
    assert tracker.offline is True and tracker.run is not None
    tracker.log({"loss": 0.5}, step=1)
    tracker.summary({"best": 0.5})
    tracker.finish()
    hint = [line for line in capsys.readouterr().out.splitlines() if "wandb sync" in line]
    assert len(hint) == 1
    run_dir = Path(hint[0].split("wandb sync ", 1)[1])
    assert run_dir.is_dir() and run_dir.name.startswith("offline-run-") and output in run_dir.parents
    assert any(run_dir.glob("*.wandb"))  # the run's data, ready to sync
    files = [path for path in output.rglob("*") if path.is_file()]
    assert len(files) > 3
    leaks = [str(path) for path in files if secret.encode() in path.read_bytes()]
    assert leaks == []



LOST_SERVICE = """
import signal, sys, time
import psutil
from types import SimpleNamespace
from accelerate.state import PartialState
from common.tracking import Tracker
PartialState(cpu=True)  # accelerate's process state, as in a run: accelerate's trackers log through it
main = SimpleNamespace(is_main_process=True)
tracker = Tracker(main, sys.argv[1], kind="wandb", project="tests", config={})
tracker.log({"loss": 0.5}, step=1)
# W&B's service, killed (the OOM killer, say; started apart, a launcher's SIGTERM to the run's tree spares it)
psutil.Process(tracker.wandb_service_pid).send_signal(signal.SIGTERM)
time.sleep(1)
tracker.finish()
print("stopped at step 1 by SIGTERM", flush=True)
"""


def test_a_wandb_service_killed_before_the_end_costs_the_run_neither_its_end_nor_its_last_line(
    tmp_path, no_wandb_env, repo
):
    # W&B's service may be gone when the run finishes. The run still ends normally, with one warning and its own
    # line last, not W&B's traceback.
    import subprocess

    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, "-c", LOST_SERVICE, str(tmp_path / "run")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "stopped at step 1 by SIGTERM"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: W&B could not finish")]
    assert len(warnings) == 1, done.stderr[-3000:]

QUIET_SERVICE = """
import sys
from types import SimpleNamespace
from accelerate.state import PartialState
from common.tracking import Tracker
PartialState(cpu=True)
tracker = Tracker(SimpleNamespace(is_main_process=True), sys.argv[1], kind="wandb", project="tests", config={})
tracker.log({"loss": 0.5}, step=1)
tracker.finish()
"""


def test_a_wandb_run_does_not_announce_the_service_it_started_itself(tmp_path, no_wandb_env, repo):
    # W&B says "Using an existing wandb-core service via WANDB_SERVICE." when it connects to a service started
    # elsewhere: here the run started it, apart, for itself (start_wandb_service_apart); a user reads it as a leftover.
    import subprocess

    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, "-c", QUIET_SERVICE, str(tmp_path / "run")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "W&B syncing is set to `offline`" in done.stderr  # W&B's own notices still shown
    assert "existing wandb-core service" not in done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("W&B run saved offline; upload it with: wandb sync ")

# --- credentials --------------------------------------------------------------------------------

def write_netrc(path: Path, machine: str, mode: int = 0o600, password: str = "k" * 40) -> None:
    path.write_text(f"machine {machine}\n  login user\n  password {password}\n")
    path.chmod(mode)


def test_credentials_from_the_environment(no_wandb_env, monkeypatch):
    assert wandb_has_credentials() is False
    monkeypatch.setenv("WANDB_API_KEY", "")
    assert wandb_has_credentials() is False
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_has_credentials() is True


def test_credentials_from_netrc(no_wandb_env):
    write_netrc(no_wandb_env / ".netrc", "example.com")
    assert wandb_has_credentials() is False  # a netrc, but not for W&B
    write_netrc(no_wandb_env / ".netrc", "api.wandb.ai")
    assert wandb_has_credentials() is True


def test_credentials_from_netrc_readable_by_others(no_wandb_env):
    # wandb itself reads a 0644 ~/.netrc without complaint; so must this check, or runs go offline.
    write_netrc(no_wandb_env / ".netrc", "api.wandb.ai", mode=0o644)
    assert wandb_has_credentials() is True


def test_credentials_for_a_self_hosted_server(no_wandb_env, monkeypatch):
    write_netrc(no_wandb_env / ".netrc", "wandb.example.com:8080")
    assert wandb_has_credentials() is False
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com:8080/")
    assert wandb_has_credentials() is True


def test_credentials_from_the_netrc_named_by_NETRC(no_wandb_env, monkeypatch, tmp_path):
    write_netrc(tmp_path / "elsewhere", "api.wandb.ai")
    monkeypatch.setenv("NETRC", str(tmp_path / "elsewhere"))  # wandb reads this file instead of ~/.netrc
    assert wandb_has_credentials() is True


def test_unreadable_netrc_means_no_credentials(no_wandb_env):
    (no_wandb_env / ".netrc").write_text('machine "api.wandb.ai\n')
    (no_wandb_env / ".netrc").chmod(0o600)
    assert wandb_has_credentials() is False


def test_sweep_run_dir_gives_each_wandb_agent_run_its_own_folder(monkeypatch):
    from common.tracking import sweep_run_dir

    monkeypatch.delenv("WANDB_SWEEP_ID", raising=False)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    assert sweep_run_dir("runs/x") == "runs/x"
    monkeypatch.setenv("WANDB_SWEEP_ID", "swp1")
    assert sweep_run_dir("runs/x") == "runs/x"  # no run id: not a run the agent started
    monkeypatch.setenv("WANDB_RUN_ID", "r7k2")
    assert sweep_run_dir("runs/x") == os.path.join("runs/x", "swp1", "r7k2")
    for bad in ("../up", "a/b", "..", ""):
        monkeypatch.setenv("WANDB_RUN_ID", bad)
        if bad:
            with pytest.raises(UsageError, match="WANDB_RUN_ID"):
                sweep_run_dir("runs/x")
        else:
            assert sweep_run_dir("runs/x") == "runs/x"


def test_in_a_log_file_every_log_line_starts_a_line_of_its_own(tmp_path):
    """A cluster job's log: stdout and stderr to one file, Python's own buffering (no PYTHONUNBUFFERED). The bar's
    redraws (carriage returns) left fragments glued in front of `epoch ...` lines, so `grep '^epoch'` missed them."""
    import subprocess

    from conftest import CONFIGS, REPO, clean_env
    from search.sweep import free_port

    env = clean_env()
    env.pop("PYTHONUNBUFFERED")
    log = tmp_path / "job.log"
    with log.open("w") as out:
        launched = subprocess.run(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu.yaml"),
             "--main_process_port", str(free_port()), str(REPO / "templates" / "image_classification.py"),
             "--epochs", "3", "--width", "8", "--depth", "1", "--tracker", "none",
             "--output_dir", str(tmp_path / "run")],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=300)
    text = log.read_bytes().decode()  # as written: read_text() would turn carriage returns into line ends
    assert launched.returncode == 0, text[-2000:]
    lines = text.split("\n")
    assert not [line for line in lines if "\r" in line]  # a terminal's redraw in place is a glued fragment in a file
    epochs = [number for number, line in enumerate(lines) if line.startswith("epoch ")]
    assert [lines[number].split(":")[0] for number in epochs] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"], text[-2000:]
    assert text.count("epoch ") == len(epochs)  # none glued behind anything
    # each where it happened: after the bar's line of the epoch's last step, before any later step's
    bar = [(number, int(line.split("|")[2].split("/")[0])) for number, line in enumerate(lines)
           if line.startswith("train:")]
    for epoch, number in enumerate(epochs, start=1):
        assert all(step <= 22 * epoch for at, step in bar if at < number), text
        assert all(step >= 22 * epoch for at, step in bar if at > number), text
    assert lines.index(next(line for line in lines if line.startswith("train:"))) > 1  # after the lines before it


def test_in_a_terminal_the_bar_redraws_itself_in_place_under_accelerate_launch(tmp_path):
    """The other side of the log file: in a terminal the bar stays live (carriage returns, one line redrawn), though
    accelerate's launcher hands the template a pipe for stderr; evaluation lines still start lines of their own."""
    import subprocess

    from conftest import CONFIGS, REPO, clean_env
    from search.sweep import free_port

    env = clean_env()
    env.pop("PYTHONUNBUFFERED")
    terminal, child_side = os.openpty()
    launched = subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu.yaml"),
         "--main_process_port", str(free_port()), str(REPO / "templates" / "image_classification.py"),
         "--epochs", "2", "--width", "8", "--depth", "1", "--tracker", "none", "--output_dir", str(tmp_path / "run")],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=child_side, stderr=child_side)
    os.close(child_side)
    shown = b""
    while True:
        try:
            chunk = os.read(terminal, 65536)
        except OSError:  # the terminal's other side closed: the launcher is gone
            break
        if not chunk:
            break
        shown += chunk
    os.close(terminal)
    assert launched.wait(timeout=300) == 0, shown[-2000:]
    text = shown.decode().replace("\r\n", "\n")  # the terminal's own line ends
    assert text.count("\rtrain:") > 4, text[-2000:]  # redrawn in place
    pieces = text.replace("\r", "\n").split("\n")  # a terminal shows what follows a carriage return from the left
    assert [piece.split(":")[0] for piece in pieces if piece.startswith("epoch ")] == ["epoch 1/2", "epoch 2/2"]
