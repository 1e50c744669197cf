"""Stop cleanly when the scheduler says so: SIGTERM or SIGUSR1 -> finish the step, agree, checkpoint, exit.

Slurm (and most cluster schedulers, and spot-instance agents) send SIGTERM, or a signal of your
choice such as SIGUSR1 via `--signal`, some time before they kill a job. The handler only sets a
flag; the training loop asks `stop_requested()` after each optimizer step, and all ranks agree
through one tiny all-reduce, so they stop at the same step even when only one rank got the signal.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist
from accelerate import Accelerator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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
        self.received = signum

    def stop_requested(self) -> bool:
        """True on every rank if any rank received a stop signal. Call it on all ranks at the same step."""
        local = 1 if self.received is not None else 0
        if self.num_processes == 1 or not dist.is_initialized():
            return bool(local)
        flag = torch.tensor([local], device=self.device, dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def describe(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "another rank's signal"
