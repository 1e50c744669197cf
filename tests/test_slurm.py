"""scripts/slurm_train.sbatch without Slurm: its trap, stop and requeue logic, with `scontrol` stubbed.

The batch script runs a real 2-rank job (`accelerate launch` with cpu_ddp.yaml) through
tests/fault_inject.py with no fault (it only records each rank's exit code); the test sends SIGUSR1
to the script, as Slurm's `--signal=B:USR1@120` does, and checks that both ranks checkpointed the
same step and exited 75, the script asked `scontrol requeue <job id>`, and nothing is left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, clean_env, wait_for_no_processes

SCRIPT = REPO / "scripts" / "slurm_train.sbatch"
ARGS = ("--epochs", "30", "--width", "8", "--depth", "1", "--batch_size", "96", "--num_workers", "1",
        "--log_every_steps", "1", "--tracker", "none")


def slurm_env(tmp_path: Path, job_id: str, config: str, **extra: str) -> tuple[dict[str, str], Path]:
    """The environment of a batch job `job_id` that runs tests/fault_inject.py with accelerate_configs/`config`,
    with an `scontrol` stub first on PATH that appends its arguments to the returned file, one call a line."""
    fake_bin, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (fake_bin / "scontrol").chmod(0o755)
    env = clean_env(
        PATH=os.pathsep.join([str(fake_bin), str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        SLURM_JOB_ID=job_id, SLURM_SUBMIT_DIR=str(REPO), ACCELERATE_CONFIG=f"accelerate_configs/{config}",
        TEMPLATE="tests/fault_inject.py", **extra,
    )
    return env, calls


def test_the_script_asks_slurm_for_what_the_readme_says():
    text = SCRIPT.read_text()
    for line in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@120", "trap 'forward_stop USR1' USR1",
                 "pkill -USR1 -P \"$launcher\"", "scontrol requeue \"${SLURM_JOB_ID}\"", "--resume auto &"):
        assert line in text, line
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0  # valid bash


def test_usr1_to_the_batch_script_checkpoints_every_rank_exits_75_and_requeues(tmp_path):
    out, records = tmp_path / "run", tmp_path / "records"
    env, calls = slurm_env(tmp_path, "4242", "cpu_ddp.yaml", FAULT_RECORD=str(records),
                           RUN_STATUS_FILE=str(tmp_path / "slurm-4242.status.json"))
    job = subprocess.Popen(["bash", str(SCRIPT), "templates/image_classification.py", *ARGS, "--output_dir", str(out)],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _trained_a_step(out):  # a step or more done: the signal comes in the middle of training
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.1)
        job.send_signal(signal.SIGUSR1)  # to the batch shell only, as --signal=B:USR1 does
        stdout, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    shown = f"exit {job.returncode}\n{stdout[-2000:]}\n{stderr[-4000:]}"
    assert job.returncode == 0, shown
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in records.glob("rank*.json")}
    assert sorted(ranks) == [0, 1] and {r["exit_code"] for r in ranks.values()} == {75}, (ranks, shown)
    step = ranks[0]["steps_done"]
    assert ranks[1]["steps_done"] == step, ranks
    assert f"stopped at step {step} by SIGUSR1 (preemption); checkpoint saved" in stderr, shown  # it exits 75
    progress = json.loads((out / "checkpoints" / f"step_{step:08d}" / "progress.json").read_text())
    assert progress["step"] == step and not list((out / "checkpoints").glob(".tmp-*"))
    assert calls.read_text().split("\n") == ["requeue 4242", ""]
    assert "slurm_train: run ended: preempted (exit code 75; launcher 1)" in stderr  # the launcher says 1
    assert "slurm_train: stopped by USR1, checkpoint saved; requeueing job 4242" in stderr
    assert json.loads((tmp_path / "slurm-4242.status.json").read_text())["state"] == "preempted"
    assert wait_for_no_processes(str(out), timeout=15) == []


def test_a_failed_run_ends_the_job_with_its_own_exit_code_and_is_not_requeued(tmp_path):
    out = tmp_path / "run"
    env, calls = slurm_env(tmp_path, "77", "cpu.yaml", FAULT="nan_loss", FAULT_STEP="2",
                           FAULT_RECORD=str(tmp_path / "records"), RUN_STATUS_FILE=str(tmp_path / "status.json"))
    job = subprocess.run(["bash", str(SCRIPT), "templates/image_classification.py", *ARGS, "--output_dir", str(out)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert job.returncode == 3, job.stderr[-3000:]  # the NaN's exit code, not the launcher's 1
    assert "slurm_train: run ended: failed (exit code 3; launcher 1)" in job.stderr
    assert not calls.exists()


def _trained_a_step(out: Path) -> bool:
    try:
        # read as text: the run may be writing the last line right now
        return any('"train/loss"' in line for line in (out / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return False
