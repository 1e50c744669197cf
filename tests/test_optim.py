"""common.optim: explicit LR scaling with world size, weight-decay groups, warmup + cosine schedule."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from common.optim import LR_SCALING, fused_adamw_on, scale_learning_rate, warmup_cosine, weight_decay_groups


# --- LR scaling -------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_lr_scaling_rules(world_size):
    assert scale_learning_rate(0.1, world_size, "linear") == pytest.approx(0.1 * world_size)
    assert scale_learning_rate(0.1, world_size, "sqrt") == pytest.approx(0.1 * math.sqrt(world_size))
    assert scale_learning_rate(0.1, world_size, "none") == 0.1


def test_lr_scaling_one_rank_keeps_lr_for_every_rule():
    assert {scale_learning_rate(3e-4, 1, rule) for rule in LR_SCALING} == {3e-4}


# --- weight decay groups ----------------------------------------------------------------------

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)  # 2-D
        self.conv = torch.nn.Conv2d(1, 4, 3)  # 4-D kernel + bias
        self.norm = torch.nn.LayerNorm(4)  # 1-D scale + shift
        self.head = torch.nn.Linear(4, 3)  # 2-D + bias
        self.scale = torch.nn.Parameter(torch.ones(()))  # 0-D
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_weight_decay_only_on_matrices_and_kernels():
    net = Net()
    decay, no_decay = weight_decay_groups(net, 0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    ids = lambda params: {id(p) for p in params}  # noqa: E731
    assert ids(decay["params"]) == ids([net.embed.weight, net.conv.weight, net.head.weight])
    assert ids(no_decay["params"]) == ids([net.conv.bias, net.norm.weight, net.norm.bias, net.head.bias, net.scale])


def test_weight_decay_groups_skip_frozen_and_hold_each_parameter_once():
    net = Net()
    groups = weight_decay_groups(net, 0.1)
    listed = [id(p) for group in groups for p in group["params"]]
    assert len(listed) == len(set(listed))
    assert set(listed) == {id(p) for p in net.parameters() if p.requires_grad}
    # The groups are what AdamW takes, and it really applies decay only to the first.
    optimizer = torch.optim.AdamW(groups, lr=0.1)
    with torch.no_grad():
        net.head.bias.fill_(1.0)
        net.head.weight.fill_(1.0)
    for param in net.parameters():
        param.grad = torch.zeros_like(param) if param.requires_grad else None
    optimizer.step()
    assert torch.all(net.head.bias == 1.0)  # zero gradient, no decay: unchanged
    assert torch.all(net.head.weight < 1.0)  # zero gradient, decayed


# --- warmup + cosine --------------------------------------------------------------------------

def lr_curve(warmup: int, total: int, min_ratio: float = 0.1, extra: int = 5, peak: float = 1.0) -> list[float]:
    """The learning rate each optimizer step uses, for `total + extra` steps (scheduler stepped after each)."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=peak)
    scheduler = warmup_cosine(optimizer, warmup, total, min_ratio)
    lrs = []
    for _ in range(total + extra):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_warmup_cosine_shape():
    warmup, total, min_ratio = 10, 110, 0.1
    lrs = lr_curve(warmup, total, min_ratio, peak=2.0)
    assert lrs[0] == pytest.approx(2.0 / (warmup + 1))  # starts low, not at zero (the first step still learns)
    assert all(a < b for a, b in zip(lrs[:warmup], lrs[1 : warmup + 1]))  # rises through warmup
    assert max(lrs) == pytest.approx(2.0) and lrs.index(max(lrs)) == warmup  # peak right after warmup
    assert all(a > b for a, b in zip(lrs[warmup:total], lrs[warmup + 1 : total + 1]))  # then only falls
    for fraction in (0.25, 0.5, 0.75):  # a cosine, not a straight line, between the peak and the floor
        cosine = 0.5 * (1 + math.cos(math.pi * fraction))
        expected = 2.0 * (min_ratio + (1 - min_ratio) * cosine)
        assert lrs[warmup + int(fraction * (total - warmup))] == pytest.approx(expected)
    assert lrs[total] == pytest.approx(2.0 * min_ratio)  # ends at min_ratio of the peak ...
    assert lrs[total:] == pytest.approx([2.0 * min_ratio] * 5)  # ... and stays there


def test_warmup_cosine_without_warmup_starts_at_peak():
    lrs = lr_curve(0, 20, 0.0)
    assert lrs[0] == pytest.approx(1.0)
    assert lrs[20] == pytest.approx(0.0, abs=1e-12)



def test_adamw_is_fused_on_the_cpu_unless_a_loss_scaler_must_see_skipped_steps():
    """The templates ask torch for its fused AdamW wherever it has one (the CPU included): the same update
    as the default implementation up to rounding. Not under an fp16 loss scaler: a fused step skips an
    overflow inside its kernel, and accelerate would count no skipped step (test_training_rules checks the count)."""
    cpu = SimpleNamespace(device=torch.device("cpu"), scaler=None)
    assert fused_adamw_on(cpu)
    assert not fused_adamw_on(SimpleNamespace(device=torch.device("cpu"), scaler=torch.amp.GradScaler("cpu")))
    torch.manual_seed(0)
    nets = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
    nets[1].load_state_dict(nets[0].state_dict())
    optimizers = [torch.optim.AdamW(nets[0].parameters(), lr=0.1, fused=fused_adamw_on(cpu)),
                  torch.optim.AdamW(nets[1].parameters(), lr=0.1)]
    assert optimizers[0].defaults["fused"]
    for _ in range(3):
        for net, optimizer in zip(nets, optimizers):
            optimizer.zero_grad(set_to_none=True)
            net(torch.ones(2, 8)).square().sum().backward()
            optimizer.step()
    torch.testing.assert_close(nets[0].weight, nets[1].weight)
