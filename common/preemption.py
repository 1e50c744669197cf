"""Stop cleanly when the scheduler says so: SIGTERM or SIGUSR1 -> finish the step, agree, checkpoint, exit.

Slurm (and most cluster schedulers, and spot-instance agents) send SIGTERM, or a signal of your
choice such as SIGUSR1 via `--signal`, some time before they kill a job. The handler only sets a
flag; the training loop asks `stop_requested()` after each optimizer step, and all ranks agree
through one tiny all-reduce, so they stop at the same step even when only one rank got the signal.

Under `wandb agent` the two signals mean different things. The agent itself stops a run with SIGTERM
(hyperband's early termination, a stopped or cancelled sweep): that run is over for good. SIGUSR1
stays the scheduler's warning of a preemption: that run asks W&B to requeue it (`requeue`), and the
agent that gets it again starts it under the same run id, in the same folder, where it resumes.
Outside a sweep both signals mean "preempted: requeue me" (exit code 75).
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator

from common.errors import EXIT_PREEMPTED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Agreed across ranks by MAX: a preemption warning on any rank outranks a plain stop on another.
_RANK = {None: 0, signal.SIGTERM: 1, signal.SIGUSR1: 2}


def under_sweep_agent() -> bool:
    """True in a run that `wandb agent` started: it sets both variables for the command it runs."""
    return bool(os.environ.get("WANDB_SWEEP_ID") and os.environ.get("WANDB_RUN_ID"))


class PreemptionWatcher:
    def __init__(self, accelerator: Accelerator, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        # Not the accelerator itself: the signal handlers keep this object alive to the end of the process,
        # and through the accelerator's model they would keep the process group from ever being freed
        # (common.accelerator.release_process_group).
        self.num_processes = accelerator.num_processes
        self.device = accelerator.device
        self.received: int | None = None
        for signum in signals:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if _RANK.get(signum, 1) >= _RANK.get(self.received, 0):
            self.received = signum

    def stop_requested(self) -> bool:
        """True on every rank if any rank received a stop signal. Call it on all ranks at the same step.

        Afterwards every rank holds the same `received` signal, also the ranks that got none.
        """
        local = _RANK.get(self.received, 1)
        if self.num_processes > 1 and dist.is_initialized():
            flag = torch.tensor([local], device=self.device, dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local = int(flag.item())
        if local and self.received is None:  # another rank's signal: adopt it, so every rank ends alike
            self.received = next(signum for signum, rank in _RANK.items() if rank == local)
        return bool(local)

    @property
    def requeue(self) -> bool:
        """Whether the run should come back (exit 75, and under a sweep W&B's requeue) rather than end for good."""
        if self.received is None:
            return False
        return not (under_sweep_agent() and self.received == signal.SIGTERM)

    def stop_reason(self) -> str:
        """Why the run stopped, for its last line."""
        if self.received is None:
            return "no stop signal"
        name = signal.Signals(self.received).name
        if self.requeue:
            return f"{name} (preemption)"
        return f"{name} from the W&B sweep agent (early termination or a stopped sweep: not requeued)"


def end_run(accelerator: Accelerator, status, tracker, preemption: PreemptionWatcher, stopping: bool,
            reason: str) -> None:
    """What every run does last: record how it ended (status.json, W&B), close the process group, and exit
    with 75 when it must come back (preempted, not stopped for good by a sweep agent), so a job script or
    W&B requeues it."""
    requeue = stopping and preemption.requeue
    status.end("preempted" if requeue else "stopped" if stopping else "finished", reason)
    tracker.finish(requeue=requeue, exit_code=EXIT_PREEMPTED if requeue else 0)
    accelerator.end_training()
    if requeue:
        sys.exit(EXIT_PREEMPTED)
