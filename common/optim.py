"""Optimizer pieces every template uses: their options, weight-decay groups, LR scaling with world size,
the fused AdamW choice, warmup + cosine, and the token-weighted mean of a step's gradients."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.config import option

LR_SCALING = ("none", "linear", "sqrt")


@dataclass
class OptimOptions:
    """The optimization options every template shares (a template declares a field again for its own default)."""

    batch_size: int = option(32, "Samples per process, per micro-batch.", "[1, inf)")
    gradient_accumulation_steps: int = option(1, "Micro-batches per optimizer step.", "[1, inf)")
    learning_rate: float = option(1e-3, "Peak learning rate for one process.", "(0, inf)")
    lr_scaling: str = option("none", "Scale the LR with the number of processes: none, linear or sqrt.", LR_SCALING)
    weight_decay: float = option(0.1, "AdamW weight decay (matrices, kernels and embeddings only).", "[0, inf)")
    warmup_steps: int = option(50, "Linear warmup before the cosine decay.", "[0, inf)")
    grad_clip: float = option(1.0, "Clip the gradient norm to this (0: no clipping).", "[0, inf)")


def scale_learning_rate(base_lr: float, world_size: int, rule: str) -> float:
    """The learning rate for `world_size` ranks, given one tuned for a single rank (the global batch grows with
    them): "linear" (Goyal et al. 2017) suits SGD, "sqrt" Adam-type optimizers, "none" keeps it as given."""
    if rule == "linear":
        return base_lr * world_size
    if rule == "sqrt":
        return base_lr * math.sqrt(world_size)
    return base_lr


def fused_adamw_on(accelerator) -> bool:
    """Whether to build AdamW fused (one kernel for the whole update): wherever torch has the kernel, the CPU
    included, but not with an fp16 loss scaler: a fused optimizer skips an overflowing step inside its kernel,
    where accelerate, which counts a skip by `optimizer.step` not being called, would miss it."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a torch that moved it: the default (foreach) implementation, same results up to rounding
        return False
    return accelerator.scaler is None and accelerator.device.type in _get_fused_kernels_supported_devices()


def average_over_targets(parameters: list[torch.nn.Parameter], step_sums: torch.Tensor, accelerator) -> torch.Tensor:
    """Make the gradients of summed token losses the gradient of the mean over every target token of the step.

    `step_sums` is this rank's [loss sum, target count] over the step's micro-batches, each through
    `accelerator.backward(loss sum)`, which accelerate divided by the accumulation steps and DDP / FSDP averaged over
    the ranks; multiplying back and dividing by all ranks' target count (one all-reduce, no host sync) weighs every
    target token once, whatever micro-batch and rank it is on. Call it after the step's last backward, before
    clipping. Returns every rank's sums (the same on all), for the logged loss."""
    step_sums = accelerator.reduce(step_sums, reduction="sum")
    scale = (accelerator.gradient_accumulation_steps * accelerator.num_processes) / step_sums[1].clamp_min(1)
    for param in parameters:  # one at a time: FSDP2's gradients are DTensors, which take a 0-d tensor factor
        if param.grad is not None:
            param.grad.mul_(scale)
    return step_sums


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay only matrices and conv kernels; biases, norm scales and other vectors are left alone."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                  min_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the peak LR, then cosine decay to `min_ratio` of it at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        state = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * state))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def follow_new_schedule(schedulers: list) -> list[tuple[float, float]]:
    """Set each LambdaLR's learning rate (the templates' warmup + cosine; `schedulers` may be accelerate's wrappers)
    to what its schedule gives at its current step; returns each parameter group's (old, new) rate. For a resume that
    extends the run: the schedule is the new length's, the rate the checkpoint restored the old length's."""
    changes = []
    for scheduler in schedulers:
        inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper holds the torch scheduler
        if not isinstance(inner, torch.optim.lr_scheduler.LambdaLR):
            continue
        new = [base * factor(inner.last_epoch) for base, factor in zip(inner.base_lrs, inner.lr_lambdas)]
        for group, lr in zip(inner.optimizer.param_groups, new):
            changes.append((group["lr"], lr))
            group["lr"] = lr
        inner._last_lr = new
    return changes
