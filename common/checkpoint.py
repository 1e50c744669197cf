"""Checkpoints that resume exactly: periodic and best kept apart, last K kept, every save atomic.

Layout of `<output_dir>`:
    run.json                      which template and config wrote this folder
    checkpoints/step_00000120/    periodic checkpoints (the last `keep_last` are kept)
    checkpoints/best_step_00000100/  the best one by the chosen metric (only the newest is kept)
    checkpoints/.tmp-*            a save in progress, or one a crash interrupted (never resumed from)
    model.safetensors             the final export (`common.export`): plain weights, loadable without accelerate

A folder with a final name is always complete: written under `.tmp-` by all ranks, renamed by the main process once
every rank finished and `progress.json` is synced. A save that fails on any rank fails on every rank (SaveError) and
publishes nothing; a deletion removes `progress.json` first. Saved in the background (the default:
`common.background_save`), a write that failed on any rank ends the run at the next step on every rank. A checkpoint
whose pickles could run code is refused before it loads (`common.pickle_allowlist`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors import SafetensorError

from common.config import RunOptions, config_to_dict, may_change_on_resume
from common.background_save import BackgroundSave, HostCopy, Snapshot, cannot_mirror, snapshot_state, writer_group
from common.errors import SaveError, UsageError, checkpoint_reason, inner_errors, is_rank_lost
from common.export import any_failure, from_main_process, fsync_file, fsync_tree, write_json
from common.optim import follow_new_schedule
from common.pickle_allowlist import check_pickles

PROGRESS_FILE = "progress.json"
RUN_FILE = "run.json"
_NAME = re.compile(r"^(step|best_step)_(\d{8})$")
RNG_PREFIX = "random_states_"  # accelerate's RNG file of each rank: random_states_<rank>.pkl


@dataclass
class TrainingState:
    """Where training stands; saved with every checkpoint and restored on resume."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # the epoch in progress (or the next one when batches_in_epoch == 0)
    batches_in_epoch: int = 0  # micro-batches of `epoch` already trained on (a resume skips them)
    best_metric: float | None = None
    best_step: int | None = None
    skipped_steps: int = 0  # optimizer steps the fp16 loss scaler skipped (inf/NaN gradients), over all sessions
    # The log interval in progress (on the device until logged or saved), so a resume logs an uninterrupted run's loss
    interval_loss_sum: float | torch.Tensor = 0.0
    interval_batches: int = 0
    interval_targets: float | torch.Tensor = 0.0  # target tokens (the fine-tuning template's token-weighted loss)

    def count_micro_batch(self, batches_per_epoch: int, loss: torch.Tensor | None = None) -> None:
        """One more micro-batch of `epoch` trained on (after its last, the next epoch starts). `loss` (the micro-batch's
        mean) joins the log interval, detached (no graph kept) and on the device (nothing waits for the GPU)."""
        self.batches_in_epoch += 1
        if self.batches_in_epoch == batches_per_epoch:
            self.epoch, self.batches_in_epoch = self.epoch + 1, 0
        if loss is not None:
            self.interval_loss_sum += loss.detach()
            self.interval_batches += 1

    def count_step(self, loss_sum: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> None:
        """One more optimizer step. A token-weighted loss joins the log interval here, once the step is complete:
        the step's (detached) loss sum and its count of target tokens, every rank's, on the device."""
        self.step += 1
        if loss_sum is not None:
            self.interval_loss_sum += loss_sum
            self.interval_targets += targets

    def take_interval_loss(self) -> float:
        """The log interval's mean training loss, per micro-batch or, where it was counted by `count_step`, per target
        token; read on the host only here, where a log step waits for the device. The next interval starts empty."""
        mean = float(self.interval_loss_sum) / (self.interval_batches or float(self.interval_targets))
        self.interval_loss_sum, self.interval_batches, self.interval_targets = 0.0, 0, 0.0
        return mean

    def record(self) -> dict:
        """The fields as progress.json holds them; the interval's loss sum read from the device (exact in a float)."""
        return {name: float(value) if isinstance(value, torch.Tensor) else value for name, value in vars(self).items()}

    @classmethod
    def from_record(cls, meta: dict) -> TrainingState:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in meta.items() if k in fields})


class CheckpointManager:
    """Saves and restores the whole training state: `accelerator.save_state` (what `prepare` registered, every
    rank's RNG state) and `progress.json` (step, epoch, data position, best metric)."""

    def __init__(self, accelerator: Accelerator, output_dir: str | os.PathLike, *, template: str, config: dict,
                 metric: str, mode: str = "max", keep_last: int = 3, every_steps: int = 0, seed: int = 0,
                 may_change: frozenset[str] | set[str] = may_change_on_resume(RunOptions),
                 model_info: dict | None = None, background: bool = False, timeout_s: float = 600.0,
                 length: str | None = None, total_steps: int | None = None):
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.dir = self.output_dir / "checkpoints"
        self.template, self.config, self.metric, self.mode = template, config, metric, mode
        self.keep_last, self.every_steps, self.seed = keep_last, every_steps, seed
        self.may_change = frozenset(may_change)  # the config entries a resume may change (`check_settings`)
        self.model_info = model_info  # what rebuilding and using the model needs; also in the export
        # How long the run trains: the option (--epochs, --max_steps; may grow on resume: `_extend`), optimizer steps
        self.length, self.total_steps = length, total_steps
        self.background = background
        self._pending: BackgroundSave | None = None  # the save being written in the background
        self.on_published: Callable[[int], None] | None = None  # told each completed checkpoint's step (RunStatus)
        self._host_copy = HostCopy(pin_memory=accelerator.device.type == "cuda")
        self._group = writer_group(accelerator, timeout_s) if background else None

    @classmethod
    def for_run(cls, accelerator: Accelerator, cfg, *, template: str, metric: str, mode: str,
                model_info: dict | None = None, length: str | None = None, total_steps: int | None = None,
                settings: dict | None = None) -> CheckpointManager:
        """The manager of a template's run, set from the options every template shares (`common.config.RunOptions`).
        `settings`: what else makes the run what it is (named with spaces: "records split by"), compared as options."""
        return cls(accelerator, cfg.output_dir, template=template, config=config_to_dict(cfg) | (settings or {}),
                   metric=metric, mode=mode, keep_last=cfg.keep_last, every_steps=cfg.checkpoint_every_steps,
                   seed=cfg.seed, may_change=may_change_on_resume(type(cfg)), model_info=model_info, length=length,
                   background=cfg.checkpoint_background, timeout_s=cfg.timeout_s, total_steps=total_steps)

    # ----------------------------------------------------------------------------------- resume
    def resume(self, resume: str) -> TrainingState:
        """The state `resume` names (`checkpoint_to_resume`), restored; a fresh one where there is nothing to resume."""
        self._check_run_file()
        # Each rank its own streams for dropout and augmentation from here on; a resume restores the checkpoint's.
        set_seed(self.seed, device_specific=True)
        for leftover in sorted(self.dir.glob(".tmp-*")) if self.dir.is_dir() else []:
            self.accelerator.print(f"ignoring incomplete checkpoint {leftover} (its save was interrupted)")
        chosen = from_main_process(checkpoint_to_resume(resume, self.dir))  # whatever each rank sees of the folder
        state = TrainingState() if chosen is None else self.load(chosen)
        self._write_run_file()  # only now: a refused checkpoint leaves the folder as it was
        return state

    def load(self, path: Path) -> TrainingState:
        meta = read_progress(path)
        if meta.get("template") != self.template:
            raise UsageError(f"checkpoint {path} was written by template {meta.get('template')!r}, "
                             f"not {self.template!r}")
        grown = check_settings(path, meta.get("config"), self.config, self.may_change, self.length)
        processes = self.accelerator.num_processes
        if meta.get("world_size") != processes:
            self.accelerator.print(f"warning: checkpoint {path} was written by {meta.get('world_size')} process(es), "
                                   f"resuming with {processes}: training continues, but not bit-identically")
        elif missing := [f"{RNG_PREFIX}{rank}.pkl" for rank in range(processes)
                         if not (path / f"{RNG_PREFIX}{rank}.pkl").is_file()]:
            # accelerate would silently go on without them: a resume that is not exact
            raise UsageError(f"checkpoint {path} lacks {', '.join(missing)}: it cannot resume exactly")
        check_pickles(path)  # before accelerate unpickles anything from it
        from torch.distributed.checkpoint.api import CheckpointException  # FSDP's sharded loads raise this

        try:
            self.accelerator.load_state(str(path))
        except (RuntimeError, ValueError, KeyError, FileNotFoundError, SafetensorError, pickle.UnpicklingError,
                EOFError, CheckpointException) as error:
            if isinstance(error, RuntimeError) and is_rank_lost(error):
                raise
            raise UsageError(f"checkpoint {path} does not fit this model and optimizer: "
                             f"{checkpoint_reason(error)}") from None
        state = TrainingState.from_record(meta)
        self.accelerator.print(f"resumed from {path} at step {state.step} (epoch {state.epoch}, "
                               f"batch {state.batches_in_epoch})")
        if grown is not None:
            self._extend(state.step, *grown)
        return state

    def _extend(self, step: int, before: int, after: int) -> None:
        """A run longer than its checkpoint's settings: from `step` on, the learning rate follows the new schedule."""
        changes = follow_new_schedule(self.accelerator._schedulers)
        steps = (f" ({self.total_steps * before // after} to {self.total_steps} optimizer steps)"
                 if self.total_steps else "")
        lr = (f"; the learning rate at step {step} changes from {changes[0][0]:.6g} to {changes[0][1]:.6g} "
              "(the warmup and cosine of the new length from here on)" if changes else "")
        self.accelerator.print(f"extending the run from --{self.length} {before} to {after}{steps}{lr}")

    # ------------------------------------------------------------------------------------- save
    def save(self, state: TrainingState, metric: float | None = None, *, wait: bool = False) -> Path:
        """Checkpoint this step (unless it has one) and keep the newest `keep_last`. `metric` (at an evaluation):
        the best so far is recorded in `state` and checkpointed too (sharing the periodic one's files). With `wait`
        (a preemption exit) the checkpoint is on disk when this returns, also in the background mode."""
        names = []
        if metric is not None and self.is_better(metric, state):
            state.best_metric, state.best_step = float(metric), state.step
            names.append(f"best_step_{state.step:08d}")
        periodic = f"step_{state.step:08d}"
        if not self._saved(periodic):
            names.append(periodic)
        if names:
            self._checkpoint(state, names, still_training=not wait and state.step != self.total_steps)
        if wait:
            self.wait()
        return self.dir / periodic

    def save_if_due(self, state: TrainingState) -> Path | None:
        """The periodic policy, after every optimizer step: a checkpoint every `every_steps` steps (0: only
        where the template calls `save`); a background save that failed on any rank raises here, on every rank."""
        if self._pending is not None and self._pending.failed_somewhere:
            self.wait()
        return self.save(state) if self.every_steps and state.step % self.every_steps == 0 else None

    def wait(self, raise_error: bool = True) -> None:
        """Until the checkpoint being written in the background is published (call it before the export);
        a SaveError on every rank if its write failed on any. Without a save in flight it returns at once."""
        job, self._pending = self._pending, None
        if job is not None:
            job.finish(raise_error)

    def write_failed(self) -> bool:
        """Whether this rank's background write ended in an error (`PreemptionWatcher.check_step` agrees on it)."""
        return self._pending is not None and self._pending.error is not None

    def write_failed_on_a_rank(self) -> None:
        """The ranks agreed that the background write failed on one of them: `save_if_due` raises it at this step."""
        if self._pending is not None:
            self._pending.failed_somewhere = True

    def restore_best(self, state: TrainingState) -> int:
        """Load the best checkpoint (its weights, for an export at the end of a run; `state` left as it is); the step of
        the weights now in the model: the last step's where they are the best, or no best was recorded."""
        self.wait()
        if state.best_step in (None, state.step):
            return state.step
        for optimizer in self.accelerator._optimizers if self.accelerator.distributed_type != "FSDP" else []:
            optimizer.optimizer.state.clear()  # the loaded state replaces it: not both at once (FSDP's loads in place)
        self.accelerator.load_state(str(self.dir / f"best_step_{state.best_step:08d}"))
        return state.best_step

    def is_better(self, value: float, state: TrainingState) -> bool:
        best = state.best_metric
        return math.isfinite(value) and (best is None or (value > best if self.mode == "max" else value < best))

    def kept(self) -> str:
        """For an error message: the newest complete checkpoint (a resume starts there), or that there is none."""
        self.wait(raise_error=False)  # a save in flight first: the message names what a resume finds
        existing = self.complete_checkpoints()
        return f"the last good checkpoint is kept: {existing[-1]}" if existing else "no checkpoint was saved yet"

    def complete_checkpoints(self) -> list[Path]:
        """Checkpoints that finished saving, oldest first (periodic before best at the same step)."""
        return complete_checkpoints(self.dir)

    def _saved(self, name: str) -> bool:
        """Whether a checkpoint of this name is complete or being written."""
        in_flight = self._pending is not None and name in self._pending.names
        return in_flight or (self.dir / name / PROGRESS_FILE).is_file()

    def _checkpoint(self, state: TrainingState, names: list[str], still_training: bool = True) -> None:
        """Save `state` under `names` (the first is written, the others share its files), now or in the background."""
        self.wait()  # one save at a time; a failure of the previous one ends the run here
        meta = state.record() | {"template": self.template, "world_size": self.accelerator.num_processes,
                                 "metric": self.metric, "mode": self.mode, "config": self.config}  # what `load` checks
        if self.background and (unsupported := cannot_mirror(self.accelerator)):
            self.accelerator.print(f"checkpoints are written at the step, not in the background: {unsupported}")
            self.background = False  # said once: from here on this run saves at the step
        if not self.background:
            self._write(names, meta, None, None)
            return
        snapshot = snapshot_state(self.accelerator, self.dir / f".tmp-{names[0]}", self._host_copy, still_training)
        self._pending = BackgroundSave(names, self._write, (names, meta, snapshot, self._group),
                                       hold=self.accelerator._optimizers if snapshot.in_place else None)

    def _write(self, names: list[str], meta: dict, snapshot: Snapshot | None, group) -> None:
        """Write the state under each of `names` on every rank, then drop old checkpoints. Each name passes
        three phases (public: the tests hook them), `start_folder`, `write_state` and `publish`, each ending with every
        rank learning whether any failed: a failure on one rank ends the save on all at once, not at --timeout_s."""
        from torch.distributed.checkpoint.api import CheckpointException  # what FSDP's sharded save raises

        main = self.accelerator.is_main_process
        for i, name in enumerate(names):
            final, tmp = self.dir / name, self.dir / f".tmp-{name}"
            # A twin (this step saved already under the other kind: same bytes), found by the main process for all ranks
            twin = from_main_process(_checkpoint_of_same_step(self.dir, meta["step"], exclude=name) if main else None,
                                     group)
            phases = ((main, self.start_folder, (tmp, twin)),  # a twin's files are linked, not written again
                      (twin is None, self.write_state, (tmp, snapshot if i == 0 else None, group)),
                      (main, self.publish, (tmp, final, meta, twin)))
            for runs_here, phase, args in phases:
                failure = None
                try:
                    if runs_here:
                        phase(*args)
                except (OSError, CheckpointException) as error:
                    if lost := [e for e in inner_errors(error) if is_rank_lost(e)]:
                        raise lost[0] from None
                    failure = checkpoint_reason(error)
                if (failure := any_failure(failure, group)) is not None:
                    kept = [p.name for p in self.complete_checkpoints()]
                    previous = (f"the previous checkpoints are intact (newest: {kept[-1]})" if kept
                                else "no earlier checkpoint exists")
                    raise SaveError(f"saving checkpoint {final} failed: {failure}; {previous}, "
                                    f"and the incomplete {tmp.name} is ignored on resume")
        if main:  # the newest `keep_last` periodic checkpoints and the best are kept
            done = self.complete_checkpoints()
            periodic = [p for p in done if p.name.startswith("step_")]
            best = [p for p in done if p.name.startswith("best_step_")]
            for old in periodic[: -self.keep_last] + best[:-1]:
                try:
                    _remove_checkpoint(old)
                except OSError as error:  # the new checkpoint is complete: only space is lost
                    self.accelerator.print(f"warning: could not delete the old checkpoint {old}: "
                                           f"{checkpoint_reason(error)}")
            if self.on_published is not None:
                self.on_published(meta["step"])
        any_failure(None, group)  # the others wait until the folder is as it will stay

    def start_folder(self, tmp: Path, twin: Path | None) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".tmp-*"):
            shutil.rmtree(stale)  # left by a crashed save; never a valid checkpoint
        if twin is not None:
            shutil.copytree(twin, tmp, copy_function=os.link, ignore=shutil.ignore_patterns(PROGRESS_FILE))

    def write_state(self, folder: Path, snapshot: Snapshot | None, group) -> None:
        """Every rank writes its part (shards, its RNG state): accelerate's save_state now, or a snapshot's files."""
        if snapshot is None:
            self.accelerator.save_state(str(folder))
        else:
            snapshot.write(folder, group)

    def publish(self, tmp: Path, final: Path, meta: dict, twin: Path | None) -> None:
        """`progress.json` last, everything synced, then one rename: a folder with a final name is complete."""
        write_json(tmp / PROGRESS_FILE, meta)
        fsync_tree(tmp, files=twin is None)  # a twin's linked files were synced when it was saved; not the folders
        if final.exists():
            _remove_checkpoint(final)
        os.replace(tmp, final)
        fsync_file(self.dir)

    # ------------------------------------------------------------------------------ run folder
    def _check_run_file(self) -> None:
        run_file = self.output_dir / RUN_FILE
        if not run_file.is_file():
            return
        try:
            run = json.loads(run_file.read_text())
        except (OSError, ValueError):
            raise UsageError(f"{run_file} is unreadable; this output folder holds something else") from None
        if run.get("template") != self.template:
            raise UsageError(f"{self.output_dir} holds a run of template {run.get('template')!r}; "
                             "choose another --output_dir")

    def _write_run_file(self) -> None:
        if self.accelerator.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            run = {"template": self.template, "config": self.config}
            write_json(self.output_dir / RUN_FILE, run | ({"model": self.model_info} if self.model_info else {}))
        self.accelerator.wait_for_everyone()


# ---------------------------------------------------------------------------------- what a resume refuses
_ABSENT = object()


def check_settings(path: Path, saved: dict | None, now: dict, may_change: frozenset[str],
                   length: str | None) -> tuple[int, int] | None:
    """Refuse a checkpoint of a run with other settings: resuming it would continue another run under this run's
    name. Only the options in `may_change` may differ, and `length` (--epochs, --max_steps) may grow, which extends
    the run: then (its length there, the longer one now) is returned."""
    if not isinstance(saved, dict):
        return None
    now = json.loads(json.dumps(now))  # as it would read back from JSON: lists, floats
    differ = [name for name in sorted(saved.keys() | now.keys())
              if name not in may_change and saved.get(name, _ABSENT) != now.get(name, _ABSENT)]
    before, after = saved.get(length), now.get(length)
    grown = None
    if length in differ and type(before) is int and type(after) is int and after > before:
        differ.remove(length)  # a longer run: extended (only the schedule changes, see `CheckpointManager._extend`)
        grown = (before, after)
    if not differ:
        return grown
    shown = "; ".join(f"{'--' * name.isidentifier()}{name} {_shown(saved.get(name, _ABSENT))} there, "
                      f"{_shown(now.get(name, _ABSENT))} now" for name in differ[:4])
    more = f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""
    grows = f" (--{length} may grow)" if length else ""
    weights = f" (from its weights: --init_from {path.parent.parent})" if "init_from" in now else ""
    raise UsageError(f"checkpoint {path} belongs to a run with other settings: {shown}{more}. Resume it with its own "
                     f"settings{grows}, or start a new run in another --output_dir{weights}")


def _shown(value) -> str:
    return "(not set)" if value is _ABSENT else json.dumps(value)


# ------------------------------------------------------------------------------------ the folders
def complete_checkpoints(folder: Path) -> list[Path]:
    """The checkpoints in a `checkpoints/` folder that finished saving, oldest first (periodic before best at
    the same step): the last is the one `--resume auto` continues from."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _NAME.match(path.name)
        if match and (path / PROGRESS_FILE).is_file():
            found.append((int(match.group(2)), match.group(1) == "step", path))
    return [path for _, _, path in sorted(found)]


def _checkpoint_of_same_step(folder: Path, step: int, exclude: str) -> Path | None:
    for path in complete_checkpoints(folder):
        if int(_NAME.match(path.name).group(2)) == step and path.name != exclude:
            return path
    return None


def checkpoint_to_resume(resume: str, folder: Path) -> Path | None:
    """The checkpoint `--resume` names (None: start fresh), for a run whose checkpoints go to `folder`: "auto" the
    newest complete one in `folder` (or none); "none" starts fresh and refuses a folder that holds checkpoints, so
    an earlier run is never overwritten by accident; a run folder (or its `checkpoints/`) its newest complete one."""
    existing = complete_checkpoints(folder)
    if resume == "none" and existing:
        raise UsageError(f"{folder.parent} already holds checkpoints of a run (newest: {existing[-1].name}); "
                         "pass --resume auto to continue it or choose another --output_dir")
    if resume in ("none", "auto"):
        return existing[-1] if existing else None
    path = Path(resume)
    if not path.is_dir():
        raise UsageError(f"--resume {resume}: no such checkpoint or run folder")
    if (path / PROGRESS_FILE).is_file():
        return path
    for folder in (path / "checkpoints", path):
        if found := complete_checkpoints(folder):
            return found[-1]
    raise UsageError(f"--resume {resume}: neither a complete checkpoint (no {PROGRESS_FILE}) nor a run folder with "
                     "one; pass a run's --output_dir, one of its checkpoints/step_* folders, auto or none")


def read_progress(path: Path) -> dict:
    try:
        meta = json.loads((path / PROGRESS_FILE).read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"checkpoint {path}: unreadable {PROGRESS_FILE} ({error})") from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise UsageError(f"checkpoint {path}: {PROGRESS_FILE} is not a training state record")
    return meta


def _remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint so that a kill part-way never leaves a folder that looks complete."""
    (path / PROGRESS_FILE).unlink(missing_ok=True)
    fsync_file(path)
    shutil.rmtree(path)
