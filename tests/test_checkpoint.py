"""common.checkpoint: whole-state save/resume, periodic and best apart, keep last K, atomic saves."""

from __future__ import annotations

import copy
import functools
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import common.background_save as background_save
import common.checkpoint as checkpoint_module
from common.accelerator import build_accelerator
from common.checkpoint import (
    PROGRESS_FILE,
    CheckpointManager,
    TrainingState,
    read_progress,
)
from common.errors import RunStatus, UsageError, read_status
from common.optim import warmup_cosine, weight_decay_groups
from conftest import REPO, clean_env, launch, reset_accelerate_state
from helpers import snapshot


class Tiny(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(width, 2)
        )

    def forward(self, x):
        return self.net(x)


def setup(output_dir: Path, *, width: int = 8, template: str = "tiny", keep_last: int = 3, mode: str = "max",
          init_seed: int = 0, background: bool = False, max_steps: int | None = None):
    """A fresh in-process job: Accelerator, prepared model/optimizer/scheduler, checkpoint manager; with
    `max_steps`, a run of that length (an option that may grow on resume), else one of 20 steps."""
    reset_accelerate_state()
    accelerator = build_accelerator(seed=0)
    torch.manual_seed(init_seed)
    model = Tiny(width)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.01), lr=1e-2)
    scheduler = warmup_cosine(optimizer, 2, max_steps or 20)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    length = {"length": "max_steps", "total_steps": max_steps} if max_steps else {}
    ckpt = CheckpointManager(accelerator, output_dir, template=template,
                             config={"width": width} | ({"max_steps": max_steps} if max_steps else {}),
                             metric="val/accuracy", mode=mode, keep_last=keep_last, background=background, **length)
    return SimpleNamespace(accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler, ckpt=ckpt)


def train(job, steps: int) -> None:
    """Steps whose data and dropout come from the global RNGs, so a resume is exact only if they are restored."""
    job.model.train()
    for _ in range(steps):
        x = torch.randn(8, 4) + float(np.random.rand()) + random.random()
        loss = job.model(x).pow(2).mean()
        job.accelerator.backward(loss)
        job.optimizer.step()
        job.scheduler.step()
        job.optimizer.zero_grad()


def params(job) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in job.accelerator.unwrap_model(job.model).state_dict().items()}


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def names(job) -> list[str]:
    return [p.name for p in job.ckpt.complete_checkpoints()]


@pytest.fixture
def job(tmp_path, fresh_accelerate):
    job = setup(tmp_path / "run")
    assert job.ckpt.resume("none") == TrainingState()
    return job


# --- the whole state, restored exactly -----------------------------------------------------------

def test_resume_restores_the_whole_state_exactly(tmp_path, fresh_accelerate):
    first = setup(tmp_path / "run")
    first.ckpt.resume("none")
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    train(first, 3)
    state = TrainingState(step=3, epoch=1, batches_in_epoch=5, best_metric=0.25, best_step=2)
    path = first.ckpt.save(state)
    assert path.name == "step_00000003"
    assert (path / "random_states_0.pkl").is_file()  # this rank's RNG is part of the checkpoint
    at_save = params(first), copy.deepcopy(first.optimizer.state_dict()), first.scheduler.get_last_lr()
    # What an uninterrupted run does next: draws, then two more training steps.
    draws = torch.rand(3).tolist(), float(np.random.rand()), random.random()
    train(first, 2)
    uninterrupted = params(first)

    # A new job (other initial weights, other RNG states) resumes and must continue identically.
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    resumed = setup(tmp_path / "run", init_seed=5)
    assert not same_tensors(params(resumed), at_save[0])
    restored = resumed.ckpt.resume("auto")
    assert restored == state  # step, epoch, position in the epoch, best metric and its step
    assert same_tensors(params(resumed), at_save[0])
    optimizer_state = resumed.optimizer.state_dict()
    assert optimizer_state["param_groups"] == at_save[1]["param_groups"]
    for index, moments in at_save[1]["state"].items():
        assert same_tensors(optimizer_state["state"][index], moments)  # AdamW moments and step count
    assert resumed.scheduler.get_last_lr() == at_save[2]
    assert resumed.scheduler.scheduler.last_epoch == 3
    assert (torch.rand(3).tolist(), float(np.random.rand()), random.random()) == draws  # torch, numpy, random
    train(resumed, 2)
    assert same_tensors(params(resumed), uninterrupted)  # bit-identical continuation, dropout included


def test_progress_json_records_the_run(job):
    path = job.ckpt.save(TrainingState(step=4, epoch=2, batches_in_epoch=1))
    meta = read_progress(path)
    assert meta["template"] == "tiny" and meta["world_size"] == 1
    assert meta["metric"] == "val/accuracy" and meta["mode"] == "max"
    assert (meta["step"], meta["epoch"], meta["batches_in_epoch"]) == (4, 2, 1)
    run = json.loads((job.ckpt.output_dir / "run.json").read_text())
    assert run == {"template": "tiny", "config": {"width": 8}}


# --- the loop's bookkeeping on TrainingState ------------------------------------------------------

def test_count_micro_batch_rolls_the_epoch_over_after_its_last_batch():
    state = TrainingState()
    positions = []
    for _ in range(7):
        state.count_micro_batch(3)
        positions.append((state.epoch, state.batches_in_epoch))
    assert positions == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]  # a resume skips that many batches
    assert state.step == 0 and state.interval_batches == 0 and state.interval_loss_sum == 0.0  # no loss: not counted
    resumed = TrainingState(step=4, epoch=5, batches_in_epoch=2)  # mid-epoch, as a checkpoint restores it
    resumed.count_micro_batch(3)
    assert (resumed.epoch, resumed.batches_in_epoch) == (6, 0)
    resumed.count_step()
    assert resumed.step == 5 and (resumed.epoch, resumed.batches_in_epoch) == (6, 0)


def test_interval_loss_is_the_mean_of_its_micro_batches_kept_on_the_device_until_taken():
    weight = torch.tensor(1.0, requires_grad=True)
    state = TrainingState()
    for value in (1.0, 2.0, 4.5):
        state.count_micro_batch(10, weight * value)  # a loss with its autograd graph, as the loop has it
    # Not read on the host (a tensor, no float), and no graph kept alive through the sum
    assert isinstance(state.interval_loss_sum, torch.Tensor) and not state.interval_loss_sum.requires_grad
    assert state.interval_batches == 3
    assert state.take_interval_loss() == 2.5  # (1 + 2 + 4.5) / 3
    assert (state.interval_loss_sum, state.interval_batches, state.interval_targets) == (0.0, 0, 0.0)
    state.count_micro_batch(10, torch.tensor(3.0))
    state.count_step()  # the step counts no loss of its own: the micro-batches did
    assert state.take_interval_loss() == 3.0  # the next interval starts empty


def test_token_weighted_interval_loss_is_the_mean_over_the_target_tokens_of_its_steps():
    state = TrainingState()
    state.count_micro_batch(10)
    state.count_step(loss_sum=torch.tensor(6.0), targets=torch.tensor(3.0))  # a mean of 2 over 3 tokens
    state.count_micro_batch(10)
    state.count_step(loss_sum=torch.tensor(10.0), targets=torch.tensor(1.0))  # a mean of 10 over 1 token
    assert state.step == 2 and state.interval_batches == 0
    assert isinstance(state.interval_loss_sum, torch.Tensor) and isinstance(state.interval_targets, torch.Tensor)
    assert state.take_interval_loss() == 4.0  # 16 / 4 tokens, not the mean of the steps' means (6)
    assert (state.interval_loss_sum, state.interval_batches, state.interval_targets) == (0.0, 0, 0.0)
    state.count_step(loss_sum=torch.tensor(1.5), targets=torch.tensor(2.0))
    assert state.take_interval_loss() == 0.75


@pytest.mark.parametrize("by", ["batches", "targets"])
def test_an_interval_cut_by_a_checkpoint_logs_after_the_resume_what_it_would_have(job, tmp_path, by):
    state = TrainingState(step=1)
    for value in (0.3, 0.7, 1.9):
        if by == "batches":
            state.count_micro_batch(10, torch.tensor(value))
        else:
            state.count_step(loss_sum=torch.tensor(value), targets=torch.tensor(value * 2 + 1))
    job.ckpt.save(state)
    restored = setup(tmp_path / "run").ckpt.resume("auto")
    assert restored.take_interval_loss() == state.take_interval_loss()


# --- periodic and best, keep last K ------------------------------------------------------------

def test_keep_last_k_periodic_and_best_kept_apart(tmp_path, fresh_accelerate):
    job = setup(tmp_path / "run", keep_last=2)
    job.ckpt.resume("none")
    state = TrainingState(step=1)
    job.ckpt.save(state, 0.5)
    for step in range(2, 6):
        state.step = step
        job.ckpt.save(state)
    # Only the newest two periodic checkpoints stay; the best one is never deleted by keep-last.
    assert names(job) == ["best_step_00000001", "step_00000004", "step_00000005"]
    assert read_progress(job.ckpt.dir / "step_00000005")["best_metric"] == 0.5


def test_only_the_newest_best_is_kept_and_only_better_values_count(job):
    state = TrainingState(step=1)
    job.ckpt.save(state, float("nan"))  # not a best, not even as the first value
    assert state.best_metric is None and names(job) == ["step_00000001"]
    job.ckpt.save(state, 0.5)
    state.step = 2
    for not_better in (0.4, 0.5, float("nan")):  # worse, equal, not a number
        job.ckpt.save(state, not_better)
    assert (state.best_metric, state.best_step) == (0.5, 1)
    assert names(job) == ["best_step_00000001", "step_00000001", "step_00000002"]
    state.step = 3
    job.ckpt.save(state, 0.9)
    assert (state.best_metric, state.best_step) == (0.9, 3)
    assert names(job) == ["step_00000001", "step_00000002", "best_step_00000003", "step_00000003"]
    assert read_progress(job.ckpt.dir / "best_step_00000003")["best_metric"] == 0.9


def test_a_better_value_at_the_same_step_replaces_that_best(job):
    state = TrainingState(step=4)
    job.ckpt.save(state, 0.5)
    job.ckpt.save(state, 0.6)  # evaluated twice at one step
    assert names(job) == ["best_step_00000004", "step_00000004"]
    assert read_progress(job.ckpt.dir / "best_step_00000004")["best_metric"] == 0.6


def test_best_in_min_mode(tmp_path, fresh_accelerate):
    job = setup(tmp_path / "run", mode="min")
    job.ckpt.resume("none")
    state = TrainingState(step=1)
    job.ckpt.save(state, 2.0)
    state.step = 2
    job.ckpt.save(state, 3.0)
    assert names(job) == ["best_step_00000001", "step_00000001", "step_00000002"]
    job.ckpt.save(state, 1.0)
    assert names(job) == ["step_00000001", "best_step_00000002", "step_00000002"]


# --- one step, one write -----------------------------------------------------------------------

def test_save_at_a_step_that_has_a_checkpoint_does_not_rewrite_it(job, monkeypatch):
    first = job.ckpt.save(TrainingState(step=3, batches_in_epoch=2))
    before = snapshot(job.ckpt.dir)
    calls = []
    monkeypatch.setattr(job.accelerator, "save_state", lambda *a, **k: calls.append(a))
    assert job.ckpt.save(TrainingState(step=3, batches_in_epoch=9)) == first
    assert calls == [] and snapshot(job.ckpt.dir) == before


def test_best_and_periodic_at_one_step_share_files_but_not_progress(job, monkeypatch):
    state = TrainingState(step=6, epoch=2, batches_in_epoch=4)
    calls = []
    real_save_state = job.accelerator.save_state
    monkeypatch.setattr(job.accelerator, "save_state", lambda *a, **k: calls.append(a) or real_save_state(*a, **k))
    job.ckpt.save(state, 0.7)
    assert len(calls) == 1  # the state was written once for both ...
    best, periodic = job.ckpt.dir / "best_step_00000006", job.ckpt.dir / "step_00000006"
    files = sorted(p.name for p in best.iterdir() if p.name != PROGRESS_FILE)
    assert "model.safetensors" in files and "random_states_0.pkl" in files
    assert sorted(p.name for p in periodic.iterdir() if p.name != PROGRESS_FILE) == files
    for name in files:  # ... and hard-linked: the same inode, no copy
        assert (best / name).stat().st_ino == (periodic / name).stat().st_ino
    assert (best / PROGRESS_FILE).stat().st_ino != (periodic / PROGRESS_FILE).stat().st_ino
    assert read_progress(best)["batches_in_epoch"] == read_progress(periodic)["batches_in_epoch"] == 4
    assert read_progress(periodic)["best_metric"] == read_progress(best)["best_metric"] == 0.7


def test_periodic_then_best_at_one_step_keeps_each_progress(job):
    state = TrainingState(step=6)
    job.ckpt.save(state)
    job.ckpt.save(state, 0.7)
    best, periodic = job.ckpt.dir / "best_step_00000006", job.ckpt.dir / "step_00000006"
    assert (best / "model.safetensors").stat().st_ino == (periodic / "model.safetensors").stat().st_ino
    assert read_progress(periodic)["best_metric"] is None  # written before this best existed; left alone
    assert read_progress(best)["best_metric"] == 0.7 and read_progress(best)["best_step"] == 6


def test_best_survives_keep_last_deleting_its_twin(tmp_path, fresh_accelerate):
    job = setup(tmp_path / "run", keep_last=1)
    job.ckpt.resume("none")
    train(job, 1)
    state = TrainingState(step=2)
    job.ckpt.save(state, 0.5)
    weights = params(job)
    state.step = 3
    job.ckpt.save(state)
    assert names(job) == ["best_step_00000002", "step_00000003"]
    other = setup(tmp_path / "elsewhere", init_seed=3)
    assert other.ckpt.resume(str(tmp_path / "run" / "checkpoints" / "best_step_00000002")).step == 2
    assert same_tensors(params(other), weights)


# --- atomic saves --------------------------------------------------------------------------------

def crash(output_dir, *args, **kwargs):
    """accelerator.save_state killed half-way: a partial file written, then the error."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "model.safetensors").write_bytes(b"half a tensor")
    (Path(output_dir) / "stray.bin").write_bytes(b"from the interrupted save")
    raise OSError("No space left on device")


def test_a_crash_mid_save_leaves_the_previous_checkpoint_intact(job, monkeypatch, capsys):
    job.ckpt.save(TrainingState(step=2))
    weights = params(job)
    before = snapshot(job.ckpt.dir)

    monkeypatch.setattr(job.accelerator, "save_state", crash)
    train(job, 1)
    with pytest.raises(OSError, match="No space left"):
        job.ckpt.save(TrainingState(step=4))
    leftover = job.ckpt.dir / ".tmp-step_00000004"
    assert leftover.is_dir()
    assert names(job) == ["step_00000002"]
    assert {k: v for k, v in snapshot(job.ckpt.dir).items() if not k.startswith(".tmp-")} == before
    monkeypatch.undo()

    # The next job resumes from the last complete checkpoint and says it skipped the broken one.
    capsys.readouterr()
    again = setup(job.ckpt.output_dir, init_seed=7)
    assert again.ckpt.resume("auto").step == 2
    assert same_tensors(params(again), weights)
    assert f"ignoring incomplete checkpoint {leftover}" in capsys.readouterr().out
    # Its next save (at the same step, as resumed runs do) clears the leftover: nothing of it remains.
    again.ckpt.save(TrainingState(step=4))
    assert not leftover.exists()
    assert not list(again.ckpt.dir.glob(".tmp-*"))
    assert names(again) == ["step_00000002", "step_00000004"]
    files = lambda name: sorted(p.name for p in (again.ckpt.dir / name).iterdir())  # noqa: E731
    assert files("step_00000004") == files("step_00000002")


def test_an_explicit_path_to_an_interrupted_save_is_refused(job, monkeypatch):
    monkeypatch.setattr(job.accelerator, "save_state", crash)
    with pytest.raises(OSError):
        job.ckpt.save(TrainingState(step=1))
    with pytest.raises(UsageError, match="neither a complete checkpoint .no progress.json. nor a run folder"):
        job.ckpt.resume(str(job.ckpt.dir / ".tmp-step_00000001"))


# --- status.json follows the checkpoints ---------------------------------------------------------------

@pytest.mark.parametrize("background", [False, True], ids=["at-the-step", "background"])
def test_status_step_is_the_last_complete_checkpoint_while_running(tmp_path, fresh_accelerate, background):
    """While running, status.json's step is where a resume would continue: written once per checkpoint (by the
    writer thread in the background mode), not per step; a checkpoint completing after the end changes nothing."""
    job = setup(tmp_path / "run", background=background)
    state = job.ckpt.resume("none")
    status = RunStatus(job.accelerator, job.ckpt.output_dir, state, job.ckpt)
    assert read_status(job.ckpt.output_dir)["step"] == 0
    state.step = 3
    job.ckpt.save(state)
    state.step = 5  # trained on, no checkpoint yet: a resume would still continue from 3
    job.ckpt.wait()
    assert {k: read_status(job.ckpt.output_dir)[k] for k in ("state", "step")} == {"state": "running", "step": 3}
    status.end("stopped", "--stop_after_steps")
    status.checkpointed(7)  # too late: the end state stays
    assert {k: read_status(job.ckpt.output_dir)[k] for k in ("state", "step")} == {"state": "stopped", "step": 5}


# --- resume arguments and refusals ------------------------------------------------------------------

def test_resume_none_refuses_a_folder_with_checkpoints_and_changes_nothing(job, tmp_path):
    job.ckpt.save(TrainingState(step=2))
    (job.ckpt.output_dir / "metrics.jsonl").write_text('{"step": 2}\n')
    before = snapshot(job.ckpt.output_dir)
    fresh = setup(job.ckpt.output_dir, init_seed=1)
    with pytest.raises(UsageError, match="already holds checkpoints.*--resume auto") as info:
        fresh.ckpt.resume("none")
    assert "\n" not in str(info.value)
    assert snapshot(job.ckpt.output_dir) == before


def test_resume_auto_takes_the_newest_complete_checkpoint(job):
    job.ckpt.save(TrainingState(step=1))
    state = TrainingState(step=3, batches_in_epoch=7)
    job.ckpt.save(state)
    state.batches_in_epoch = 8
    job.ckpt.save(state, 0.5)  # same step as the periodic one, another progress: the periodic one is resumed
    job.ckpt.save(TrainingState(step=2))
    (job.ckpt.dir / "step_00000009").mkdir()  # a folder without progress.json is not a checkpoint
    (job.ckpt.dir / "step_00000009" / "model.safetensors").write_bytes(b"")
    assert names(job) == ["step_00000001", "step_00000002", "best_step_00000003", "step_00000003"]
    resumed = setup(job.ckpt.output_dir, init_seed=2)
    assert resumed.ckpt.resume("auto") == TrainingState(step=3, batches_in_epoch=7)


def test_resume_a_run_folder_takes_its_newest_complete_checkpoint(job, tmp_path):
    """`--resume runs/x` (or runs/x/checkpoints) continues from what `--resume auto` would pick in runs/x."""
    job.ckpt.save(TrainingState(step=1))
    state = TrainingState(step=3, batches_in_epoch=7)
    job.ckpt.save(state)
    state.batches_in_epoch = 8
    job.ckpt.save(state, 0.5)  # same step as the periodic one, another progress: the periodic one is resumed
    (job.ckpt.dir / "step_00000009").mkdir()  # a folder without progress.json is not a checkpoint
    for given in (job.ckpt.output_dir, job.ckpt.dir):
        other = setup(tmp_path / f"from_{given.name}", init_seed=2)
        assert other.ckpt.resume(str(given)) == TrainingState(step=3, batches_in_epoch=7)


def test_resume_a_folder_without_checkpoints_names_what_to_pass(job, tmp_path):
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    for given in (tmp_path / "empty_run", tmp_path / "empty_run" / "checkpoints"):
        with pytest.raises(UsageError) as info:
            job.ckpt.resume(str(given))
        assert str(info.value) == (f"--resume {given}: neither a complete checkpoint (no progress.json) nor a run "
                                   "folder with one; pass a run's --output_dir, one of its checkpoints/step_* folders, "
                                   "auto or none")


def test_resume_none_and_auto_in_an_empty_folder_start_fresh(tmp_path, fresh_accelerate):
    for mode in ("none", "auto"):
        job = setup(tmp_path / mode)
        assert job.ckpt.resume(mode) == TrainingState()
        assert (tmp_path / mode / "run.json").is_file()


def test_resume_path_that_does_not_exist(job, tmp_path):
    with pytest.raises(UsageError, match="no such checkpoint or run folder"):
        job.ckpt.resume(str(tmp_path / "nowhere"))


def test_resume_path_without_progress(job, tmp_path):
    (tmp_path / "junk").mkdir()
    with pytest.raises(UsageError, match="neither a complete checkpoint .no progress.json. nor a run folder"):
        job.ckpt.resume(str(tmp_path / "junk"))


def test_output_folder_of_another_template_is_refused(job, tmp_path):
    job.ckpt.save(TrainingState(step=1))
    other = setup(job.ckpt.output_dir, template="language_model")
    for mode in ("auto", "none"):
        with pytest.raises(UsageError, match="holds a run of template 'tiny'"):
            other.ckpt.resume(mode)


def test_checkpoint_of_another_template_is_refused(job, tmp_path):
    path = job.ckpt.save(TrainingState(step=1))
    other = setup(tmp_path / "other_run", template="language_model")
    with pytest.raises(UsageError, match="written by template 'tiny', not 'language_model'"):
        other.ckpt.resume(str(path))


def test_checkpoint_for_another_model_shape_is_refused_in_one_line(job, tmp_path):
    path = job.ckpt.save(TrainingState(step=1))
    wider = setup(tmp_path / "wider", width=16)
    wider.ckpt.config = job.ckpt.config  # the same settings, a model changed in the code
    with pytest.raises(UsageError) as info:
        wider.ckpt.resume(str(path))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint {path} does not fit this model and optimizer: ")
    assert "size mismatch for " in message and ": checkpoint (" in message and ", model (" in message, message


def test_checkpoint_of_other_settings_is_refused_naming_them_and_nothing_is_written(job, tmp_path):
    path = job.ckpt.save(TrainingState(step=1))
    before = snapshot(job.ckpt.output_dir)
    for resume in ("auto", str(path)):  # the run's own folder, and the checkpoint named from elsewhere
        output = job.ckpt.output_dir if resume == "auto" else tmp_path / "elsewhere"
        other = CheckpointManager(job.accelerator, output, template="tiny", config={"width": 8, "lr": 0.5},
                                  metric="val/accuracy")
        with pytest.raises(UsageError) as info:
            other.resume(resume)
        message = str(info.value)
        assert "\n" not in message and "belongs to a run with other settings: --lr (not set) there, 0.5 now" in message
        assert "another --output_dir" in message
    assert snapshot(job.ckpt.output_dir) == before and not (tmp_path / "elsewhere").exists()


def test_the_refusal_of_other_settings_is_short_and_names_the_way_to_start_from_its_weights(job, tmp_path):
    """What a user wants after the refusal: a new run from those weights with the other settings (--init_from,
    where the template has it), said in one short line, not a list of every option that may change."""
    for step, saved in enumerate(({"width": 8, "init_from": None}, {"width": 8}), start=1):
        job.ckpt.config = saved  # the second as the fine-tuning template has it: it starts from --model instead
        path = job.ckpt.save(TrainingState(step=step))
        hint = f" (from its weights: --init_from {path.parent.parent})" if "init_from" in saved else ""
        other = CheckpointManager(job.accelerator, tmp_path / "new", template="tiny", config=saved | {"lr": 0.5},
                                  metric="val/accuracy", may_change={"keep_last", "output_dir"})
        with pytest.raises(UsageError) as info:
            other.resume(str(path))
        message = str(info.value)
        assert message == (f"checkpoint {path} belongs to a run with other settings: --lr (not set) there, 0.5 now. "
                           f"Resume it with its own settings, or start a new run in another --output_dir{hint}")
        assert len(message) - len(str(path)) - len(hint) < 200


def test_a_longer_run_extends_its_checkpoint_with_the_schedule_of_the_new_length(tmp_path, fresh_accelerate, capsys):
    """--max_steps 10 trained to its end, resumed with 16: the learning rate of step 10 on is the 16-step
    schedule's (restored from the checkpoint it was the 10-step one's), and it says so; a shorter run is refused."""
    short = setup(tmp_path / "run", max_steps=10)
    short.ckpt.resume("none")
    train(short, 10)
    path = short.ckpt.save(TrainingState(step=10))
    weights, ended_at = params(short), short.optimizer.param_groups[0]["lr"]
    assert ended_at == pytest.approx(1e-2 * 0.1)  # the cosine's end

    capsys.readouterr()
    longer = setup(tmp_path / "run", max_steps=16)
    assert longer.ckpt.resume("auto").step == 10
    assert same_tensors(params(longer), weights)
    new_lr = 1e-2 * warmup_cosine(torch.optim.SGD([torch.zeros(1)], lr=1), 2, 16).lr_lambdas[0](10)
    assert [g["lr"] for g in longer.optimizer.param_groups] == [new_lr] * 2 == longer.scheduler.get_last_lr()
    assert (f"extending the run from --max_steps 10 to 16 (10 to 16 optimizer steps); the learning rate at step 10 "
            f"changes from {ended_at:.6g} to {new_lr:.6g} (the warmup and cosine of the new length from here on)"
            in capsys.readouterr().out)
    train(longer, 1)
    assert longer.optimizer.param_groups[0]["lr"] == pytest.approx(
        1e-2 * warmup_cosine(torch.optim.SGD([torch.zeros(1)], lr=1), 2, 16).lr_lambdas[0](11))

    with pytest.raises(UsageError) as info:  # a shorter run is another run
        setup(tmp_path / "run", max_steps=9).ckpt.resume(str(path))
    assert str(info.value).startswith(f"checkpoint {path} belongs to a run with other settings: --max_steps 10 "
                                      "there, 9 now. ") and "(--max_steps may grow)" in str(info.value)


def test_options_that_may_change_on_resume_do_not_block_it(job, tmp_path):
    job.ckpt.config = {"width": 8, "keep_last": 3, "output_dir": "a", "custom": 1}
    path = job.ckpt.save(TrainingState(step=3))
    moved = {"width": 8, "keep_last": 1, "output_dir": "b", "custom": 1}
    again = CheckpointManager(job.accelerator, tmp_path / "b", template="tiny", config=moved, metric="val/accuracy")
    assert again.resume(str(path)).step == 3
    custom = dict(moved, custom=2)
    allowed = CheckpointManager(job.accelerator, tmp_path / "c", template="tiny", config=custom, metric="val/accuracy",
                                may_change={"output_dir", "keep_last", "custom"})
    assert allowed.resume(str(path)).step == 3
    refused = CheckpointManager(job.accelerator, tmp_path / "d", template="tiny", config=custom, metric="val/accuracy")
    with pytest.raises(UsageError, match="--custom 1 there, 2 now"):
        refused.resume(str(path))


def test_unreadable_progress_or_run_file_is_a_usage_error(job):
    path = job.ckpt.save(TrainingState(step=1))
    (path / PROGRESS_FILE).write_text("{not json")
    with pytest.raises(UsageError, match="unreadable progress.json"):
        read_progress(path)
    (job.ckpt.output_dir / "run.json").write_text("\x00")
    with pytest.raises(UsageError, match="run.json is unreadable"):
        job.ckpt.resume("auto")


def test_resume_with_another_world_size_warns(job, capsys):
    path = job.ckpt.save(TrainingState(step=1))
    meta = json.loads((path / PROGRESS_FILE).read_text())
    (path / PROGRESS_FILE).write_text(json.dumps(meta | {"world_size": 4}))
    capsys.readouterr()
    assert job.ckpt.resume("auto").step == 1
    assert "written by 4 process(es), resuming with 1" in capsys.readouterr().out


# --- two ranks ----------------------------------------------------------------------------------------

TWO_RANK_SCRIPT = textwrap.dedent("""
    import json, random, sys
    import numpy as np
    import torch
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {tests!r})
    from accelerate.utils import set_seed
    from common.checkpoint import CheckpointManager, TrainingState
    from test_checkpoint import setup, train

    output = sys.argv[1]
    job = setup(output)
    set_seed(0, device_specific=True)  # as the templates do: each rank its own RNG stream
    job.ckpt.resume("auto")
    train(job, 2)
    job.ckpt.save(TrainingState(step=2))
    after_save = [torch.rand(2).tolist(), float(np.random.rand()), random.random()]
    ticks = job.scheduler.scheduler.last_epoch
    torch.manual_seed(99); np.random.seed(99); random.seed(99)
    again = CheckpointManager(job.accelerator, output, template="tiny", config={{"width": 8}}, metric="val/accuracy")
    state = again.resume("auto")
    after_load = [torch.rand(2).tolist(), float(np.random.rand()), random.random()]
    with open(f"{{output}}/rank{{job.accelerator.process_index}}.json", "w") as handle:
        json.dump({{"world": job.accelerator.num_processes, "after_save": after_save, "after_load": after_load,
                   "step": state.step, "ticks": ticks,
                   "ticks_restored": job.scheduler.scheduler.last_epoch}}, handle)
""")


def test_two_ranks_save_and_restore_each_ranks_rng(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANK_SCRIPT.format(repo=str(REPO), tests=str(REPO / "tests")))
    output = tmp_path / "run"
    result = launch("cpu_ddp.yaml", script, str(output), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((output / f"rank{r}.json").read_text()) for r in (0, 1)]
    checkpoint = output / "checkpoints" / "step_00000002"
    assert (checkpoint / "random_states_0.pkl").is_file() and (checkpoint / "random_states_1.pkl").is_file()
    assert read_progress(checkpoint)["world_size"] == 2
    for rank in ranks:
        assert rank["world"] == 2 and rank["step"] == 2
        assert rank["after_load"] == rank["after_save"]  # each rank got its own RNG state back ...
        assert rank["ticks"] == rank["ticks_restored"] == 2  # one scheduler tick per optimizer step
    assert ranks[0]["after_save"] != ranks[1]["after_save"]  # ... and not the other rank's
    assert not list((output / "checkpoints").glob(".tmp-*"))


# --- kills between the steps of a save or a deletion ------------------------------------------------

class Kill(BaseException):
    """Stands in for SIGKILL at one point of a save: a BaseException, so no `except OSError` sees it."""


COMPLETE_FILES = {PROGRESS_FILE, "model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"}


class KillAt:
    """Counts the filesystem operations on checkpoints/ (saving the state, writing progress.json, renames,
    unlinks, tree copies and deletions) and kills the process at operation `at`: before it, or, for
    save_state and rmtree, half-way through (files half-written; some files deleted, progress.json last)."""

    def __init__(self, monkeypatch, manager, checkpoints: Path, at: int):
        self.count, self.at, self.fired = 0, at, None
        inside = lambda path: Path(path).resolve().is_relative_to(checkpoints.resolve())  # noqa: E731

        def point(what: str) -> bool:
            """Counts an operation; True when the kill falls on it."""
            self.count += 1
            if self.count == self.at:
                self.fired = what
                return True
            return False

        def before(real, what):
            @functools.wraps(real)
            def wrapper(*args, **kwargs):
                if inside(args[0]) and point(what):
                    raise Kill(what)
                return real(*args, **kwargs)
            return wrapper

        real_write_state, real_rmtree = manager.write_state, shutil.rmtree

        def write_state(output_dir, *args, **kwargs):  # the write phase: save_state, or a snapshot's files
            if point("before save_state"):
                raise Kill("before save_state")
            result = real_write_state(output_dir, *args, **kwargs)
            if point("in save_state"):
                for file in Path(output_dir).iterdir():  # every file cut to half: the kill came mid-write
                    if file.is_file():
                        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
                raise Kill("in save_state")
            return result

        def rmtree(path, *args, **kwargs):
            if inside(path) and point(f"before rmtree {Path(path).name}"):
                raise Kill("before rmtree")
            if inside(path) and point(f"in rmtree {Path(path).name}"):
                for file in sorted(Path(path).iterdir(), key=lambda p: p.name == PROGRESS_FILE)[:2]:
                    file.unlink()  # two files gone, progress.json (if still there) the last to go
                raise Kill("in rmtree")
            return real_rmtree(path, *args, **kwargs)

        monkeypatch.setattr(manager, "write_state", write_state)
        monkeypatch.setattr(shutil, "rmtree", rmtree)
        monkeypatch.setattr(os, "replace", before(os.replace, "os.replace"))
        monkeypatch.setattr(Path, "unlink", before(Path.unlink, "unlink"))
        monkeypatch.setattr(shutil, "copytree", before(shutil.copytree, "copytree"))
        monkeypatch.setattr(Path, "write_text", before(Path.write_text, "progress.json"))  # its temporary file


@pytest.mark.parametrize("background", [False, True], ids=["at-the-step", "background"])
def test_a_kill_at_any_point_of_saving_publishing_or_deleting_leaves_only_complete_checkpoints(tmp_path,
                                                                                                 fresh_accelerate,
                                                                                                 background):
    """A checkpoint at step 3 that is the new best, in a run keeping 2: save the best and link the periodic one
    to it (deleting the previous best and the oldest periodic one), then a better best at the same step (linked
    to the periodic one, replacing the first). Killed before or inside each filesystem operation of that in
    turn, the folder must hold no folder under a final name that looks complete (progress.json) and is not, nor
    an incomplete one that was never complete (a save published early); a folder being deleted may be left
    half-deleted, without its progress.json; and resume picks the newest complete checkpoint and loads exactly
    the weights saved there. In the background the kill strikes the writing thread (the training thread learns
    of it at `wait`)."""
    at, outcomes = 0, []
    while True:
        at += 1
        job = setup(tmp_path / f"kill{at}", keep_last=2, background=background)
        job.ckpt.resume("none")
        weights = {}
        state = TrainingState(step=1)
        for step in (1, 2):
            train(job, 1)
            state.step = step
            job.ckpt.save(state, 0.1 * step)
            weights[step] = params(job)
            job.ckpt.wait()
        train(job, 1)
        weights[3] = params(job)
        assert names(job) == ["step_00000001", "best_step_00000002", "step_00000002"]
        published = set(names(job))  # complete checkpoints before the interrupted call: these may be deleted
        with pytest.MonkeyPatch.context() as monkeypatch:
            kill = KillAt(monkeypatch, job.ckpt, job.ckpt.dir, at)
            try:
                state.step = 3
                for metric in (0.8, 0.9):  # a best and the periodic one, then a better best at the same step
                    job.ckpt.save(state, metric)
                    job.ckpt.wait()
                    published |= set(names(job))
            except Kill:
                pass
        if kill.fired is None:
            break  # the save ran to its end: every point before was tried
        outcomes.append(kill.fired)
        where = f"killed {kill.fired} (operation {at})"
        for folder in job.ckpt.dir.iterdir():
            if folder.name.startswith(".tmp-"):
                continue
            files = {p.name for p in folder.iterdir()}
            if PROGRESS_FILE in files:
                assert files == COMPLETE_FILES, f"{where}: {folder.name} looks complete but holds {sorted(files)}"
                saved = read_progress(folder)["step"]
                other = setup(tmp_path / f"check{at}-{folder.name}", init_seed=9)
                other.ckpt.config = job.ckpt.config
                assert other.ckpt.resume(str(folder)).step == saved, where
                assert same_tensors(params(other), weights[saved]), f"{where}: {folder.name} holds other weights"
            else:
                # only a deletion (of a checkpoint that was complete) may leave an incomplete folder under a final name
                assert folder.name in published, f"{where}: {folder.name} is published but incomplete: {sorted(files)}"
        job.ckpt.kept()  # a kill in the writing thread ends it; the process ends here too
        again = setup(job.ckpt.output_dir, init_seed=5)
        resumed = again.ckpt.resume("auto")
        assert resumed.step in (2, 3), where
        assert same_tensors(params(again), weights[resumed.step]), where
    # the points tried: the state saved, progress.json written, renamed, old ones deleted, the twin linked
    assert at > 10 and any("in rmtree" in o for o in outcomes) and "in save_state" in outcomes
    assert {"os.replace", "progress.json", "copytree", "unlink"} <= set(outcomes)


def test_a_deletion_cut_short_leaves_no_folder_that_looks_complete(tmp_path, fresh_accelerate, monkeypatch):
    """keep-last's deletion removes progress.json first: killed inside the tree deletion, the half-deleted
    folder is not a checkpoint, resume ignores it, and the newest one is resumed."""
    job = setup(tmp_path / "run", keep_last=1)
    job.ckpt.resume("none")
    job.ckpt.save(TrainingState(step=1))
    train(job, 1)
    weights = params(job)
    real_rmtree = shutil.rmtree

    def rmtree_killed_half_way(path, *args, **kwargs):
        for file in sorted(Path(path).iterdir(), key=lambda p: p.name == PROGRESS_FILE)[:2]:
            file.unlink()  # what a kill in the middle of rmtree leaves: some files gone, others not
        raise Kill("in rmtree")

    monkeypatch.setattr(shutil, "rmtree", rmtree_killed_half_way)
    with pytest.raises(Kill):
        job.ckpt.save(TrainingState(step=2))
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    half = job.ckpt.dir / "step_00000001"
    assert half.is_dir() and not (half / PROGRESS_FILE).exists(), sorted(p.name for p in half.iterdir())
    assert names(job) == ["step_00000002"]
    again = setup(job.ckpt.output_dir, init_seed=3)
    assert again.ckpt.resume("auto").step == 2
    assert same_tensors(params(again), weights)


# --- background saves -------------------------------------------------------------------------------

def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != PROGRESS_FILE}


def test_a_background_save_writes_the_files_save_state_writes(tmp_path, fresh_accelerate):
    """Byte for byte what accelerate's save_state writes at the same moment, so load_state reads either."""
    job = setup(tmp_path / "run", background=True)
    job.ckpt.resume("none")
    train(job, 2)
    job.ckpt.save(TrainingState(step=2))
    job.accelerator.save_state(str(tmp_path / "save_state"))  # no random draw between the two: same RNG states
    job.ckpt.wait()
    written = files_of(job.ckpt.dir / "step_00000002")
    assert set(written) == {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"}
    assert written == files_of(tmp_path / "save_state")


class Gate:
    """Holds the background writer at its start until `open()`; records the order of snapshots and writes."""

    def __init__(self, monkeypatch, manager):
        self.event, self.log = threading.Event(), []
        real_snapshot, real_write_state = checkpoint_module.snapshot_state, manager.write_state

        def snapshot(accelerator, folder, *args):
            self.log.append(f"copy {folder.name}")
            return real_snapshot(accelerator, folder, *args)

        def write_state(folder, *args):  # the write phase that writes the state's files
            self.event.wait(timeout=60)
            self.log.append(f"write {folder.name}")
            return real_write_state(folder, *args)

        monkeypatch.setattr(checkpoint_module, "snapshot_state", snapshot)
        monkeypatch.setattr(manager, "write_state", write_state)

    def open(self):
        self.event.set()


def test_training_goes_on_while_the_save_is_written_and_the_checkpoint_holds_the_step(tmp_path, fresh_accelerate,
                                                                                       monkeypatch):
    job = setup(tmp_path / "run", background=True)
    job.ckpt.resume("none")
    train(job, 2)
    at_save = params(job)
    gate = Gate(monkeypatch, job.ckpt)
    job.ckpt.save(TrainingState(step=2))  # returns with the state copied, before anything is written
    assert names(job) == [] and gate.log == ["copy .tmp-step_00000002"]
    train(job, 3)  # training goes on meanwhile and changes every parameter in place
    assert not same_tensors(params(job), at_save)
    gate.open()
    job.ckpt.wait()
    assert names(job) == ["step_00000002"]
    again = setup(job.ckpt.output_dir, init_seed=4)
    assert again.ckpt.resume("auto").step == 2
    assert same_tensors(params(again), at_save)  # the step's weights, not the later ones


def test_the_next_save_waits_for_the_one_being_written(tmp_path, fresh_accelerate, monkeypatch):
    job = setup(tmp_path / "run", background=True, keep_last=1)
    job.ckpt.resume("none")
    gate = Gate(monkeypatch, job.ckpt)
    train(job, 1)
    job.ckpt.save(TrainingState(step=1))
    threading.Timer(0.2, gate.open).start()
    train(job, 1)
    job.ckpt.save(TrainingState(step=2))  # one save at a time: its copy waits until the first is published
    job.ckpt.wait()
    assert gate.log == ["copy .tmp-step_00000001", "write .tmp-step_00000001", "copy .tmp-step_00000002",
                        "write .tmp-step_00000002"]
    assert names(job) == ["step_00000002"]  # keep_last 1: the first was published, then deleted


def test_a_save_with_wait_is_on_disk_when_it_returns(tmp_path, fresh_accelerate, monkeypatch):
    job = setup(tmp_path / "run", background=True)
    job.ckpt.resume("none")
    train(job, 1)
    job.ckpt.save(TrainingState(step=1), wait=True)  # as a preemption exit saves
    assert names(job) == ["step_00000001"]
    sync = setup(tmp_path / "sync")  # --checkpoint_background false: every save at the step
    sync.ckpt.resume("none")
    sync.ckpt.save(TrainingState(step=1))
    assert names(sync) == ["step_00000001"]


def test_a_failed_background_write_ends_the_run_at_the_next_step(tmp_path, fresh_accelerate, monkeypatch):
    """The failure is agreed in the step's check (PreemptionWatcher.check_step) and raised by save_if_due
    there, as a save at the step raises it; the previous checkpoints stay as they were."""
    from common.accelerator import PreemptionWatcher
    from common.errors import SaveError

    job = setup(tmp_path / "run", background=True)
    job.ckpt.resume("none")
    job.ckpt.save(TrainingState(step=1), wait=True)
    before = snapshot(job.ckpt.dir)
    monkeypatch.setattr(job.ckpt, "write_state", crash)
    watcher = PreemptionWatcher(job.accelerator, signals=())
    state = TrainingState(step=2)
    job.ckpt.save(state)
    job.ckpt._pending._thread.join()  # the write has failed; the training thread has not looked yet
    assert job.ckpt.save_if_due(state) is None  # not agreed yet: the step before the check goes on
    assert watcher.check_step(torch.tensor(1.0), job.ckpt) is True
    with pytest.raises(SaveError, match=r"saving checkpoint \S+step_00000002 failed: No space left on device; "
                                        r"the previous checkpoints are intact \(newest: step_00000001\)"):
        job.ckpt.save_if_due(state)
    assert {k: v for k, v in snapshot(job.ckpt.dir).items() if not k.startswith(".tmp-")} == before


TWO_RANK_BACKGROUND_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, {repo!r})
    from common.accelerator import build_accelerator, release_process_group
    from common.checkpoint import CheckpointManager, TrainingState

    class Block(torch.nn.Module):  # the class fsdp.yaml wraps
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, x):
            return torch.relu(self.linear(x))

    def main():  # as a template's: what refers to the process group is gone when main() returns
        output = sys.argv[1]
        accelerator = build_accelerator(seed=0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(16, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

        def train(steps):
            for _ in range(steps):
                loss = model(torch.randn(4, 16)).pow(2).mean()
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

        def manager(folder, background):
            return CheckpointManager(accelerator, f"{{output}}/{{folder}}", template="tiny", config={{}}, metric="m",
                                     background=background)

        background, at_the_step = manager("background", True), manager("at_the_step", False)
        background.resume("none"), at_the_step.resume("none")
        train(2)
        weights = {{k: v.clone() for k, v in accelerator.get_state_dict(model).items()}}
        background.save(TrainingState(step=2))
        at_the_step.save(TrainingState(step=2))  # the same state: nothing trained or drawn in between
        train(2)  # while the background save is written
        background.wait()
        again = manager("background", True)
        again.resume("auto")
        restored = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            same = sorted(weights) == sorted(restored) and all(torch.equal(weights[k], restored[k]) for k in weights)
            with open(f"{{output}}/result.json", "w") as handle:
                json.dump({{"restored_step_2": same, "still_background": background.background,
                           "kind": accelerator.distributed_type.value}}, handle)

    main()
    release_process_group()  # what the templates' with_exit_codes does: gloo's threads end before shutdown
""")


@pytest.mark.parametrize("config", ["cpu_ddp.yaml", "fsdp.yaml"])
def test_two_ranks_background_saves_write_what_save_state_writes_and_resume_exactly(tmp_path, config):
    """DDP (the main process writes the model) and FSDP2 (every rank writes its shards through
    torch.distributed.checkpoint, in the background on a process group of its own)."""
    import pickle

    script = tmp_path / "two_ranks_background.py"
    script.write_text(TWO_RANK_BACKGROUND_SCRIPT.format(repo=str(REPO)))
    output = tmp_path / "run"
    result = launch(config, script, str(output), num_processes=2, timeout=120)  # fsdp.yaml says 8 (GPUs)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads((output / "result.json").read_text())
    assert outcome == {"restored_step_2": True, "still_background": True,
                       "kind": "FSDP" if config == "fsdp.yaml" else "MULTI_CPU"}, outcome
    written = files_of(output / "background" / "checkpoints" / "step_00000002")
    expected = files_of(output / "at_the_step" / "checkpoints" / "step_00000002")
    assert sorted(written) == sorted(expected) and "random_states_1.pkl" in written
    if config == "fsdp.yaml":
        assert {"pytorch_model_fsdp_0/__1_0.distcp", "optimizer_0/__1_0.distcp"} <= set(written)
    for name in written:
        if name.endswith(".metadata"):  # torch.distributed.checkpoint's index: the same but for its path and id
            index = [pickle.loads(files[name]) for files in (written, expected)]
            assert [(m.state_dict_metadata, m.storage_data) for m in index][0] == \
                   [(m.state_dict_metadata, m.storage_data) for m in index][1], name
        else:
            assert written[name] == expected[name], name


def test_for_run_takes_the_shared_options_and_the_switch_to_saves_at_the_step(tmp_path, fresh_accelerate):
    from common.config import RunOptions

    job = setup(tmp_path / "unused")
    for background in (True, False):
        cfg = RunOptions(output_dir=str(tmp_path / f"run-{background}"), keep_last=2, checkpoint_every_steps=5,
                         seed=3, timeout_s=60, checkpoint_background=background)
        manager = CheckpointManager.for_run(job.accelerator, cfg, template="tiny", metric="val/accuracy", mode="max")
        assert (manager.background, manager.keep_last, manager.every_steps, manager.seed) == (background, 2, 5, 3)
        assert manager.output_dir == tmp_path / f"run-{background}"
        assert manager.config["checkpoint_background"] is background  # recorded with the run (may change on resume)
        manager.resume("none")
        manager.save(TrainingState(step=1))
        assert (manager._pending is not None) is background  # in flight, or written at the step
        manager.wait()
        assert [p.name for p in manager.complete_checkpoints()] == ["step_00000001"]


def test_a_state_background_saves_cannot_mirror_is_saved_at_the_step_and_said_once(tmp_path, fresh_accelerate,
                                                                                    capsys):
    class Counter:  # an object accelerate saves as custom_checkpoint_0.pkl: the background writer does not
        def __init__(self):
            self.count = 0

        def state_dict(self):
            return {"count": self.count}

        def load_state_dict(self, state):
            self.count = state["count"]

    job = setup(tmp_path / "run", background=True)
    job.accelerator.register_for_checkpointing(Counter())
    job.ckpt.resume("none")
    for step in (1, 2):
        job.ckpt.save(TrainingState(step=step))
        assert job.ckpt._pending is None and (job.ckpt.dir / f"step_{step:08d}" / "custom_checkpoint_0.pkl").is_file()
    out = capsys.readouterr().out
    assert out.count("checkpoints are written at the step, not in the background: objects registered with "
                     "accelerator.register_for_checkpointing") == 1, out


def test_an_accelerate_without_what_background_saves_mirror_starts_and_saves_at_the_step(tmp_path, fresh_accelerate,
                                                                                          monkeypatch, capsys):
    """accelerate 1.10 to 1.14 (which requirements.txt allows) have no fsdp_utils._unwrap_optimizer: the templates
    still import, and such a run saves at the step, said once, instead of failing."""
    import accelerate
    import accelerate.utils.fsdp_utils

    code = ("import sys, accelerate.utils.fsdp_utils as f, accelerate.checkpointing as c; "
            "del f._unwrap_optimizer, c.get_torch_accelerator_backend; "
            "sys.path.insert(0, 'templates'); import image_classification, language_model")
    imported = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                              timeout=120)
    assert imported.returncode == 0, imported.stderr[-2000:]
    monkeypatch.delattr(accelerate.utils.fsdp_utils, "_unwrap_optimizer")
    job = setup(tmp_path / "run", background=True)
    job.ckpt.resume("none")
    for step in (1, 2):
        job.ckpt.save(TrainingState(step=step))
        assert job.ckpt._pending is None  # written at the step
    assert names(job) == ["step_00000001", "step_00000002"]
    out = capsys.readouterr().out
    assert out.count(f"checkpoints are written at the step, not in the background: accelerate {accelerate.__version__} "
                     "has no accelerate.utils.fsdp_utils._unwrap_optimizer") == 1, out


class TinyWithBatchNorm(Tiny):
    def __init__(self, width: int = 8):
        super().__init__(width)
        self.net.insert(1, torch.nn.BatchNorm1d(width))  # buffers that forward changes: copied at the save


@pytest.mark.parametrize("device", ["cpu", "cpu, batch norm", "as on a gpu"])
def test_a_background_save_holds_no_second_copy_in_host_memory_where_it_can(tmp_path, fresh_accelerate, monkeypatch,
                                                                            device):
    """At the run's last step a background save writes the model's and optimizer's own tensors and lets go of any
    copy kept from a save before. Mid-run it copies them to host memory (training changes them meanwhile), except on
    a device whose state is in host memory already (the CPU): there it writes the parameters and optimizer state as
    they are, and the next optimizer step waits for the write. Either way: one copy of weights and optimizer state
    in host memory where it can be, the files those save_state writes at the save, and an exact resume."""
    if device == "as on a gpu":
        monkeypatch.setattr(background_save, "IN_HOST_MEMORY", ())  # the copy a GPU's state needs
    if device == "cpu, batch norm":
        monkeypatch.setitem(globals(), "Tiny", TinyWithBatchNorm)
    job = setup(tmp_path / "run", background=True, max_steps=4)
    job.ckpt.resume("none")
    snapshots = []
    real_snapshot = checkpoint_module.snapshot_state
    monkeypatch.setattr(checkpoint_module, "snapshot_state",
                        lambda *args: snapshots.append(real_snapshot(*args)) or snapshots[-1])
    real_write = background_save.Snapshot.write
    monkeypatch.setattr(background_save.Snapshot, "write",  # a slow disk: training goes on meanwhile
                        lambda self, *args: time.sleep(0.5) or real_write(self, *args))
    live = {tensor.data_ptr() for tensor in job.model.state_dict().values()}

    def shared(snapshot) -> int:  # tensors of the snapshot's weights file that are the model's own
        weights = next(obj for name, _, obj in snapshot.files if name == "model.safetensors")
        return sum(tensor.data_ptr() in live for tensor in weights.values())

    train(job, 2)
    job.ckpt.save(TrainingState(step=2))
    job.accelerator.save_state(str(tmp_path / "at_step_2"))  # no random draw between the two: same RNG states
    train(job, 2)  # its first optimizer step changes the state the save writes
    job.ckpt.wait()
    assert files_of(job.ckpt.dir / "step_00000002") == files_of(tmp_path / "at_step_2")
    if device.startswith("cpu"):
        parameters = len(list(job.model.parameters()))
        assert shared(snapshots[0]) == parameters and not job.ckpt._host_copy.buffers.get("model.safetensors")
    else:
        assert shared(snapshots[0]) == 0 and job.ckpt._host_copy.buffers  # a copy, kept for the next save
    job.ckpt.save(TrainingState(step=4))
    job.accelerator.save_state(str(tmp_path / "save_state"))
    job.ckpt.wait()
    assert shared(snapshots[1]) == len(live) and not job.ckpt._host_copy.buffers
    assert files_of(job.ckpt.dir / "step_00000004") == files_of(tmp_path / "save_state")
    at_end = params(job)
    again = setup(job.ckpt.output_dir, init_seed=4, max_steps=4)
    assert again.ckpt.resume("auto").step == 4 and same_tensors(params(again), at_end)
