"""The Accelerator, built the same way for every template (CPU, one GPU, DDP, FSDP2), and the run around it:
`start_run` (output folder, Accelerator, stop signals, seed), `end_run` (end state, exit code) and the freeing
of the process group before Python shuts down."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import functools
import gc
import os
import resource
import select
import signal
import stat
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import accelerate.accelerator
import accelerate.optimizer
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import (DataLoaderConfiguration, DistributedType, FullyShardedDataParallelPlugin,
                               GradientAccumulationPlugin, InitProcessGroupKwargs, set_seed)

from common.background_save import finish_background_saves
from common.checkpoint import CheckpointManager
from common.data import STOP_SIGNALS
from common.errors import EXIT_PREEMPTED, StoppedBeforeTraining, UsageError, ignore_ctrl_c
from common.tracking import say, sweep_run_dir

if dist.is_available():
    # Imported before any process group exists: its functions' default `group=group.WORLD`, evaluated on import,
    # would otherwise hold the live group forever (DDP imports it lazily), never to be freed (release_process_group).
    import torch.distributed.nn.functional

_GROUPS: list = []  # the process group build_accelerator joined: release_process_group() drops the last reference

# accelerate asks at every step whether lomo_optim is installed, an uncached search; packages do not change mid-run
for _module in (accelerate.optimizer, accelerate.accelerator):
    if hasattr(_module, "is_lomo_available") and not hasattr(_module.is_lomo_available, "cache_info"):
        _module.is_lomo_available = functools.cache(_module.is_lomo_available)


def resolve_mixed_precision(requested: str, has_cuda: bool, has_bf16: bool) -> str:
    """bf16 where the hardware has it, fp16 (with a loss scaler) on older GPUs, none on CPU."""
    if not has_cuda:
        if requested in ("bf16", "fp16"):
            warnings.warn(f"mixed_precision={requested} ignored: training on CPU runs in fp32")
        return "no"
    if requested == "auto":
        return "bf16" if has_bf16 else "fp16"
    if requested == "bf16" and not has_bf16:
        warnings.warn("this GPU has no bf16; using fp16 with a loss scaler instead")
        return "fp16"
    return requested


def build_accelerator(*, seed: int, mixed_precision: str = "auto", gradient_accumulation_steps: int = 1,
                      timeout_s: float = 600.0, force_cpu: bool = False) -> Accelerator:
    """Create the Accelerator from the `accelerate launch` config plus the template's settings. CPU ranks get
    `cpu=True` (without it, processes launched by a MULTI_GPU config would each train alone) and, where the launch
    config asks for FSDP, FSDP2 on gloo (accelerate turns FSDP on for GPUs only). `timeout_s` bounds every
    collective, so a dead rank ends the job instead of hanging it."""
    use_cpu = force_cpu or not torch.cuda.is_available()
    has_bf16 = (not use_cpu) and torch.cuda.is_bf16_supported()
    precision = resolve_mixed_precision(mixed_precision, has_cuda=not use_cpu, has_bf16=has_bf16)
    if use_cpu:  # accelerate reads this too: every later PartialState() agrees
        os.environ["ACCELERATE_USE_CPU"] = "true"
    accelerator = Accelerator(
        cpu=use_cpu, mixed_precision=precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=gradient_accumulation_steps,
                                                                sync_with_dataloader=True),
        # Same shuffle on every rank (each then takes its shard) and a new one each epoch from seed + epoch.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed, non_blocking=not use_cpu),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))],
        # The templates step the scheduler once per optimizer step, sized in those steps; accelerate's default
        # steps it num_processes times per call, ending warmup and decay early under DDP/FSDP.
        step_scheduler_with_optimizer=False)
    if use_cpu and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        _enable_fsdp2_on_cpu(accelerator)
    if dist.is_available() and dist.is_initialized():
        _GROUPS.append(dist.group.WORLD)
    return accelerator


# --------------------------------------------------------------------------------- stop signals
# SIGTERM or SIGUSR1 (Slurm's `--signal`, spot-instance agents: some time before a kill) -> finish the step, agree,
# checkpoint, exit. The handler only sets a flag (before the session's first step, on one process, it ends the run:
# StoppedBeforeTraining); the ranks agree on it after each optimizer step, so they stop at the same step even when one
# rank alone got the signal. Both mean "preempted: requeue me" (exit 75), except under `wandb agent`, whose own
# SIGTERM (early termination, a stopped sweep) ends a run for good; SIGUSR1 stays a preemption (W&B requeues the run).
# Agreed across ranks by MAX: a preemption warning on any rank outranks a plain stop on another.
_RANK = {None: 0, signal.SIGTERM: 1, signal.SIGUSR1: 2}


def stop_with_the_launcher(launcher: int) -> None:
    """Under `accelerate launch` or torchrun (not `python train.py`, which a shell's end must not stop), on Linux: a
    SIGTERM when the launcher ends, whatever ends it (kill -9, the OOM killer): the run stops as at a preemption."""
    if sys.platform.startswith("linux") and {"ACCELERATE_DYNAMO_BACKEND", "TORCHELASTIC_RUN_ID"} & os.environ.keys():
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # it ended before
            os.kill(os.getpid(), signal.SIGTERM)


def _silence_pipes_without_reader() -> None:
    """stdout and stderr, where each is a pipe no process reads any more (it polls POLLERR): /dev/null from here on."""
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                (poller := select.poll()).register(fd, select.POLLOUT)
                if any(event & select.POLLERR for _, event in poller.poll(0)):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)


def under_sweep_agent() -> bool:
    """True in a run that `wandb agent` started: it sets both variables for the command it runs."""
    return bool(os.environ.get("WANDB_SWEEP_ID") and os.environ.get("WANDB_RUN_ID"))


class PreemptionWatcher:
    def __init__(self, accelerator: Accelerator, signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
                 stop_after_steps: int = 0, launcher: int | None = None):
        # Not the accelerator: the handlers keep this alive, and its model would keep the process group from being freed
        self.num_processes = accelerator.num_processes
        self.device = accelerator.device
        self.received: int | None = None
        self.stop_agreed = False  # the last `stop_requested()` answer: the ranks stop for a signal (`end_run`)
        self._agreed: int | None = None  # the stop flag check_step agreed on, for the next stop_requested()
        self.stop_after_steps = stop_after_steps  # --stop_after_steps: this session's optimizer steps (0: no limit)
        self.session_steps = 0  # optimizer steps of this session: the calls of check_step
        self.launcher, self.launcher_gone = launcher or os.getppid(), False  # (stop_with_the_launcher)
        for signum in signals:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if _RANK.get(signum, 1) >= _RANK.get(self.received, 0):
            self.received = signum
        if os.getppid() != self.launcher and not self.launcher_gone:
            self.launcher_gone = True
            _silence_pipes_without_reader()  # the launcher's: the run's last writes would fail it (EPIPE)
        # Once (the launcher passes on a signal its process group got too), and not with several ranks: one rank's
        # end here would meet the others in a collective (and torchrun gives its ranks 30 s, not accelerate's 5).
        if self.session_steps == 0 and self.num_processes == 1 and not self.stop_agreed:
            self.stop_agreed = True
            raise StoppedBeforeTraining("preempted" if self.requeue else "stopped", self.stop_reason())

    def check_step(self, grad_norm: torch.Tensor, checkpoints: CheckpointManager | None = None) -> bool:
        """Whether `grad_norm` is finite; in the same exchange the ranks agree on stop signals and on whether the
        background write of `checkpoints` (the run's CheckpointManager, passed at each call, never kept) failed. Call on
        every rank at each optimizer step, after clipping and before `optimizer.step()`, so non-finite gradients are
        never applied. One small all-reduce and one host sync for all three; the `stop_requested()` that follows answers
        from it, and `save_if_due` raises a failed background save at this step on every rank. Each call counts one
        optimizer step of the session (for `stop_now`)."""
        self.session_steps += 1
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
            grad_norm = grad_norm.full_tensor()
        flags = torch.zeros(3, dtype=torch.int32, device=self.device)  # filled on the device: no host copy
        flags[0] = ~torch.isfinite(grad_norm.detach().reshape(()))
        flags[1] = _RANK.get(self.received, 1)
        flags[2] = checkpoints is not None and checkpoints.write_failed()
        if self.num_processes > 1 and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # the norm is the same everywhere; the rest is not
        non_finite, self._agreed, save_failed = flags.tolist()
        if save_failed and checkpoints is not None:
            checkpoints.write_failed_on_a_rank()
        return not non_finite

    def stop_requested(self) -> bool:
        """True on every rank if any rank received a stop signal. Call it on all ranks at the same step: it answers
        from this step's `check_step`, or agrees itself. Then every rank holds the same `received` signal."""
        local, self._agreed = self._agreed, None
        if local is None:
            local = _RANK.get(self.received, 1)
            if self.num_processes > 1 and dist.is_initialized():
                flag = torch.tensor([local], device=self.device, dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                local = int(flag.item())
        if local and self.received is None:  # another rank's signal: adopt it, so every rank ends alike
            self.received = next(signum for signum, rank in _RANK.items() if rank == local)
        self.stop_agreed = bool(local)
        return self.stop_agreed

    def stop_now(self) -> bool:
        """Whether the run stops at this step, on every rank alike: a stop signal any rank received (`stop_requested`),
        or --stop_after_steps optimizer steps taken in this session. Call it once per optimizer step, after the step."""
        return self.stop_requested() or self.session_steps == self.stop_after_steps

    @property
    def requeue(self) -> bool:
        """Whether the run should come back (exit 75, and under a sweep W&B's requeue) rather than end for good."""
        return self.received is not None and not (under_sweep_agent() and self.received == signal.SIGTERM)

    def stop_reason(self) -> str:
        """Why the run stopped, for its last line."""
        if self.received is None:
            return "no stop signal"
        name = signal.Signals(self.received).name + " at the end of its launcher" * self.launcher_gone
        if self.requeue:
            return f"{name} (preemption)"
        return f"{name} from the W&B sweep agent (early termination or a stopped sweep: not requeued)"


def end_run(accelerator: Accelerator, *, status, tracker, preemption: PreemptionWatcher, stopping: bool,
            reason: str | None = None) -> None:
    """What every run does last: record how it ended (status.json, W&B), close the process group, say why it stopped
    (last, after W&B's line; on stderr when it exits 75, which `accelerate launch` shows) and exit 75 when it must come
    back. `stopping`: it stopped for a stop signal or --stop_after_steps and checkpointed there; the reason recorded
    is the agreed signal, else --stop_after_steps, unless the template gives its own `reason` (early stopping). A
    Ctrl-C is ignored from here on (`ignore_ctrl_c`; `with_exit_codes` gives it back as main() returns)."""
    ignore_ctrl_c()
    if reason is None:
        reason = (preemption.stop_reason() if preemption.stop_agreed else "--stop_after_steps") if stopping else ""
    requeue = stopping and preemption.requeue
    status.end("preempted" if requeue else "stopped" if stopping else "finished", reason)
    tracker.finish(requeue=requeue, exit_code=EXIT_PREEMPTED if requeue else 0)
    accelerator.end_training()
    if stopping and accelerator.is_main_process:
        print(f"stopped at step {status.state.step} by {reason}; checkpoint saved, continue with --resume auto",
              file=sys.stderr if requeue else sys.stdout, flush=True)
    if requeue:
        sys.exit(EXIT_PREEMPTED)


def check_output_dir(path: str | os.PathLike, option: str = "--output_dir") -> None:
    """Refuse an output folder that is a file, or that cannot be created or written, before anything is written; by
    looking only (os.access, no probe file: a refused command leaves no trace; a read-only file system refuses root)."""
    target = existing = Path(path)
    try:
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent  # the nearest folder that exists: the new ones are made in it
        is_dir = existing.is_dir()
    except OSError as error:
        raise UsageError(f"{option} {path}: cannot look at it ({error.strerror})") from None
    if existing == target and not is_dir:
        raise UsageError(f"{option} {path} is a file, not a folder")
    if existing == target and not os.access(target, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: this folder is not writable")
    if not is_dir:
        raise UsageError(f"{option} {path} cannot be created: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path} cannot be created: {existing} is not writable")


def start_run(cfg) -> tuple[Accelerator, PreemptionWatcher]:
    """What every run does first, on every rank: its output folder (its own one under `wandb agent`, checked
    before anything is written), the Accelerator, the stop-signal watcher, and the same seed everywhere (so
    every rank builds the same initial weights; the checkpoint manager then gives each rank its own streams)."""
    launcher = os.getppid()
    stop_with_the_launcher(launcher)  # before the process group: a rank would wait for its dead launcher's store
    cfg.output_dir = sweep_run_dir(cfg.output_dir)
    check_output_dir(cfg.output_dir)
    accelerator = build_accelerator(seed=cfg.seed, mixed_precision=cfg.mixed_precision,
                                    gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                                    timeout_s=cfg.timeout_s)
    accelerator.print(describe(accelerator))
    if hasattr(faulthandler, "register") and sys.__stderr__ is not None:  # `kill -USR2 <pid>`: every thread's stack
        # on the process's own stderr (where a hung run waits), also where sys.stderr has no file (notebook, pytest)
        faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)
    preemption = PreemptionWatcher(accelerator, stop_after_steps=cfg.stop_after_steps, launcher=launcher)
    set_seed(cfg.seed)
    return accelerator, preemption


def release_process_group() -> None:
    """Destroy the process group and free it now, while Python is fully alive: gloo's worker threads end here.

    gloo's worker threads let go of a collective's tensors (which takes the GIL) a moment after the caller has the
    result, and end only when the group is freed; `destroy_process_group()` does not free it while anything refers
    to it (the model, torch's caches). A group that outlives the interpreter leaves them running into shutdown, where
    a late let-go aborts (SIGABRT: a finished run exits -6). Freeing the group joins them first. Call it after the
    training function has returned (its model holds the group too), as `with_exit_codes(release=...)` does; without
    a process group it does nothing."""
    finish_background_saves()  # a checkpoint still being written ends first: its thread uses a group of its own
    if not _GROUPS and not (dist.is_available() and dist.is_initialized()):
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # reference cycles that still reach the model
    mesh_class = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    if mesh_class is not None:
        # FSDP2's device meshes live on in DTensor's sharding caches, and each holds its process groups
        for obj in gc.get_objects():
            if mesh_class in type(obj).__mro__ and isinstance(getattr(obj, "_pg_registry", None), dict):
                obj._pg_registry.clear()
    _GROUPS.clear()  # the last reference: freeing the group joins gloo's worker threads


def _enable_fsdp2_on_cpu(accelerator: Accelerator) -> None:
    if accelerator.num_processes < 2:
        return  # nothing to shard; plain single-process training
    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* settings the launcher exported
    if plugin.fsdp_version != 2:
        raise UsageError("FSDP on CPU needs fsdp_version: 2 in the accelerate config (FSDP1 requires GPUs)")
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def describe(accelerator: Accelerator) -> str:
    """One line for the log: what kind of job this is."""
    kind = accelerator.distributed_type.value  # "NO" for one process, which reads as a refusal: left out
    kind = "" if kind == "NO" else f" ({kind})"
    return (f"{accelerator.num_processes} process{'es' * (accelerator.num_processes > 1)} on {accelerator.device.type}"
            f"{kind}, mixed precision {accelerator.mixed_precision}, gradient accumulation "
            f"{accelerator.gradient_accumulation_steps}")


# ------------------------------------------------------------------------------ what the hardware gives
# Dense bf16 tensor-core peaks in TFLOP/s per GPU (vendors' datasheets; fp16 where there is no bf16: V100, T4). The
# first name contained in the device name wins. None: no published figure, so no MFU unless --peak_tflops is given.
PEAK_TFLOPS: tuple[tuple[str, float | None], ...] = (
    ("GH200", 989.0), ("H200 NVL", 835.0), ("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("A10G", None), ("A10", 125.0), ("A40", 149.7), ("A6000", 154.8),
    ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("RTX 4090", 165.2), ("RTX 3090", 71.0), ("V100", 125.0),
    ("T4", 65.0), ("MI300X", 1307.0))


def device_peak_tflops(device: torch.device, override: float) -> float | None:
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((peak for key, peak in PEAK_TFLOPS if key.lower() in name), None)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the process's peak RSS: KiB on Linux, bytes on macOS
    return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9


class Throughput:
    """The log's speed figures over the micro-batches the loop took through `timed(batches)` since the last reading
    (`restart` leaves evaluation out): items per second, the share of time spent waiting for data, time and items
    (every process's) per optimizer step, peak memory, and MFU where the device's peak is known. Waiting more than
    `DATA_WAIT_WARNING` of the time in two intervals in a row (one is not enough: an epoch's first batch always
    waits) gets one warning naming --num_workers. `items_per_micro_batch`: a number, or a function of the batch
    giving a count on the device (a padded batch's tokens), read on the host only at the reading."""

    DATA_WAIT_WARNING = 0.1

    def __init__(self, accelerator: Accelerator, unit: str, items_per_micro_batch: int | Callable[[Any], torch.Tensor],
                 num_workers: int, flops_per_item: float = 0.0, peak_tflops: float = 0.0):
        self.device, self.processes = accelerator.device, accelerator.num_processes
        self.unit, self.items_per_micro_batch = unit, items_per_micro_batch
        self.accumulation = accelerator.gradient_accumulation_steps
        self.flops_per_item, self.peak_tflops = flops_per_item, device_peak_tflops(accelerator.device, peak_tflops)
        self.num_workers, self.warned, self.slow_intervals = num_workers, False, 0
        self.say = functools.partial(say, accelerator)
        self.restart()

    def restart(self) -> None:
        self.batches, self.items, self.waited, self.start = 0, 0, 0.0, time.perf_counter()

    def timed(self, batches):
        """`batches`, counting each one and timing how long the loop waits for it."""
        asked = time.perf_counter()
        for batch in batches:
            self.waited += time.perf_counter() - asked
            self.batches += 1
            count = self.items_per_micro_batch
            self.items += count(batch) if callable(count) else count  # a device tensor stays on the device
            yield batch
            asked = time.perf_counter()

    def read(self) -> dict[str, float]:
        """The figures since the last reading (see the class); the next interval starts."""
        elapsed = time.perf_counter() - self.start
        per_s = float(self.items) * self.processes / elapsed  # every process trains as many
        per_step = float(self.items) * self.processes * self.accumulation / max(1, self.batches)
        figures = {f"{self.unit}_per_s": per_s, f"{self.unit}_per_step": per_step,
                   "time/data_wait": self.waited / elapsed,
                   "time/step_ms": 1000 * elapsed * self.accumulation / max(1, self.batches),
                   "peak_memory_gb": peak_memory_gb(self.device)}
        if self.flops_per_item and self.peak_tflops:  # MFU: achieved model FLOP/s over the devices' peak
            mfu = self.flops_per_item * per_s / (self.processes * self.peak_tflops * 1e12)
            if mfu > 1:  # the peak is wrong: a warning (once) rather than a false number
                warnings.warn(f"MFU would be {mfu:.0%}: the peak of {self.peak_tflops:g} TFLOP/s is too low; "
                              "pass --peak_tflops")
            else:
                figures["mfu"] = mfu
        self.slow_intervals = self.slow_intervals + 1 if figures["time/data_wait"] > self.DATA_WAIT_WARNING else 0
        if self.slow_intervals == 2 and not self.warned:
            self.warned = True
            self.say(f"warning: training waited for data {figures['time/data_wait']:.0%} of the time: raise "
                     f"--num_workers (now {self.num_workers}) or make loading cheaper (bench/data_loading.py)")
        self.restart()
        return figures
