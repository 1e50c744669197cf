"""common.tracking: metrics.jsonl from the main process only, resume-safe; W&B online only with credentials."""

from __future__ import annotations

import json
import math
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.accelerator import build_accelerator
from common.errors import UsageError
from common.tracking import METRICS_FILE, Tracker, wandb_has_credentials

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
def fake_wandb(monkeypatch, no_wandb_env):
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
    tmp_path, no_wandb_env, monkeypatch, capsys
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
from common.tracking import Tracker
main = SimpleNamespace(is_main_process=True)
tracker = Tracker(main, sys.argv[1], kind="wandb", project="tests", config={})
tracker.log({"loss": 0.5}, step=1)
for child in psutil.Process().children(recursive=True):  # what a SIGTERM to the whole process tree does
    child.send_signal(signal.SIGTERM)
time.sleep(1)
tracker.finish()
print("stopped at step 1 by SIGTERM", flush=True)
"""


def test_a_wandb_service_killed_before_the_end_costs_the_run_neither_its_end_nor_its_last_line(
    tmp_path, no_wandb_env, repo
):
    # `accelerate launch` passes a SIGTERM to the whole process tree: W&B's service may be gone when the run
    # finishes. The run still ends normally, with one warning and its own line last, not W&B's traceback.
    import subprocess

    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, "-c", LOST_SERVICE, str(tmp_path / "run")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "stopped at step 1 by SIGTERM"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: W&B could not finish")]
    assert len(warnings) == 1, done.stderr[-3000:]

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
