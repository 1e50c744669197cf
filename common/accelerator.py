"""Build the Accelerator the same way for every template, on CPU, one GPU, DDP and FSDP2."""

from __future__ import annotations

import functools
import os
import warnings
from datetime import timedelta

import accelerate.accelerator
import accelerate.optimizer
import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
)

from common.config import MIXED_PRECISION_CHOICES
from common.errors import UsageError


# accelerate's optimizer wrapper asks on every step (twice) and its backward once whether the optional
# lomo_optim package is installed: an uncached import-system search costing ~0.1 ms each, measured as
# 1-4% of a small model's step time (bench/overhead.py). Installed packages do not change mid-run.
for _module in (accelerate.optimizer, accelerate.accelerator):
    if hasattr(_module, "is_lomo_available") and not hasattr(_module.is_lomo_available, "cache_info"):
        _module.is_lomo_available = functools.cache(_module.is_lomo_available)


def resolve_mixed_precision(requested: str, has_cuda: bool, has_bf16: bool) -> str:
    """bf16 where the hardware has it, fp16 (with a loss scaler) on older GPUs, none on CPU."""
    if requested not in MIXED_PRECISION_CHOICES:
        raise UsageError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION_CHOICES)}, got {requested!r}")
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


def build_accelerator(
    *,
    seed: int,
    mixed_precision: str = "auto",
    gradient_accumulation_steps: int = 1,
    timeout_s: float = 600.0,
    force_cpu: bool = False,
) -> Accelerator:
    """Create the Accelerator from the `accelerate launch` config plus the template's settings.

    - CPU ranks: without `cpu=True` two CPU processes launched by a MULTI_GPU config would never
      join a process group and would silently each train alone; with it they form one gloo job.
    - FSDP on CPU: accelerate only turns FSDP on for GPUs. For debugging and CI we switch the state
      to FSDP2 ourselves when the launch config asked for FSDP, which `fully_shard` supports on gloo.
    - `timeout_s` bounds every collective, so a dead rank ends the job instead of hanging it.
    """
    use_cpu = force_cpu or not torch.cuda.is_available()
    has_bf16 = (not use_cpu) and torch.cuda.is_bf16_supported()
    precision = resolve_mixed_precision(mixed_precision, has_cuda=not use_cpu, has_bf16=has_bf16)
    if use_cpu:
        # accelerate reads this too; setting it keeps every later PartialState() consistent
        os.environ["ACCELERATE_USE_CPU"] = "true"
    accelerator = Accelerator(
        cpu=use_cpu,
        mixed_precision=precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=gradient_accumulation_steps, sync_with_dataloader=True
        ),
        # Same shuffle on every rank (each then takes its shard) and a new one each epoch from seed + epoch.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed, non_blocking=not use_cpu),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))],
        # The templates call scheduler.step() once per optimizer step and size the schedule in those
        # steps. accelerate's default would step it num_processes times per call (it assumes a schedule
        # sized for one process), ending warmup and decay early under DDP/FSDP.
        step_scheduler_with_optimizer=False,
    )
    if use_cpu and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        _enable_fsdp2_on_cpu(accelerator)
    return accelerator


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
    kind = accelerator.distributed_type.value if hasattr(accelerator.distributed_type, "value") else accelerator.distributed_type
    return (
        f"{kind} on {accelerator.device.type}, {accelerator.num_processes} process(es), "
        f"mixed precision {accelerator.mixed_precision}, "
        f"gradient accumulation {accelerator.gradient_accumulation_steps}"
    )
