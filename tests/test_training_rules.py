"""The loop rules every template follows, checked by running each template in-process and
recording what it does: the order of zero_grad / backward / clip / step, train vs eval mode,
gather_for_metrics in evaluation, non-finite losses stopping the run, loss accumulated as floats."""

from __future__ import annotations

import ast
import functools
import math
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from conftest import REPO, load_template

TEMPLATES = {
    # template file -> (model class to watch, tiny arguments for a run of a few steps)
    "image_classification": (
        "ResNet",
        # 14 batches an epoch, so every accumulation window of 2 is full
        ["--epochs", "2", "--width", "8", "--depth", "1", "--batch_size", "96", "--warmup_steps", "2"],
    ),
    "language_model": (
        "GPT",
        ["--max_steps", "12", "--eval_every_steps", "6", "--eval_batches", "2", "--n_layer", "1", "--n_head", "2",
         "--n_embd", "16", "--block_size", "16", "--batch_size", "8", "--warmup_steps", "2", "--dropout", "0.1",
         "--sample_tokens", "0", "--log_every_steps", "2"],
    ),
}


@pytest.fixture
def fresh_accelerate(monkeypatch):
    """Accelerate keeps process-wide singletons; each in-process run starts from a clean state."""
    for key in ("ACCELERATE_USE_CPU", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION", "WANDB_MODE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


class Recorder:
    """Wraps the calls the rules are about and keeps them in order."""

    def __init__(self, monkeypatch, model_class):
        self.events: list[tuple] = []
        record = self.events.append

        def wrap(owner, name, make_event):
            original = getattr(owner, name)

            @functools.wraps(original)  # keeps the signature, which accelerate inspects
            def wrapper(*args, **kwargs):
                record(make_event(*args, **kwargs))
                return original(*args, **kwargs)

            monkeypatch.setattr(owner, name, wrapper)

        wrap(torch.optim.AdamW, "zero_grad", lambda self, set_to_none=True: ("zero_grad", set_to_none))
        wrap(torch.optim.AdamW, "step", lambda self, *a, **k: ("step",))
        wrap(Accelerator, "backward", lambda self, loss, **k: ("backward",))
        wrap(Accelerator, "clip_grad_norm_", lambda self, *a, **k: ("clip",))
        wrap(Accelerator, "gather_for_metrics", lambda self, *a, **k: ("gather",))
        wrap(model_class, "forward", lambda self, *a, **k: ("forward", self.training, torch.is_grad_enabled()))

    def windows(self) -> list[list[str]]:
        """Training events split at each optimizer step: one list per step, ending with 'step'."""
        windows, current = [], []
        for event in self.events:
            if event[0] in ("forward", "gather"):
                continue
            current.append(event[0])
            if event[0] == "step":
                windows.append(current)
                current = []
        return windows


@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("accumulation", [1, 2])
def test_step_order_zero_grad_backward_clip_step(template, accumulation, tmp_path, monkeypatch, fresh_accelerate):
    module = load_template(template)
    model_class, args = TEMPLATES[template]
    recorder = Recorder(monkeypatch, getattr(module, model_class))
    module.main([*args, "--output_dir", str(tmp_path / "run"), "--tracker", "none",
                 "--gradient_accumulation_steps", str(accumulation), "--resume", "none"])

    windows = recorder.windows()
    assert len(windows) >= 4, "the run should take several optimizer steps"
    for window in windows:
        # zero_grad(set_to_none=True) opens the step, then one backward per micro-batch,
        # clipping after the last backward, then the optimizer step.
        assert window == ["zero_grad"] + ["backward"] * accumulation + ["clip", "step"], window
    assert all(event[1] is True for event in recorder.events if event[0] == "zero_grad")


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_train_and_eval_modes(template, tmp_path, monkeypatch, fresh_accelerate):
    module = load_template(template)
    model_class, args = TEMPLATES[template]
    recorder = Recorder(monkeypatch, getattr(module, model_class))
    module.main([*args, "--output_dir", str(tmp_path / "run"), "--tracker", "none", "--resume", "none"])

    forwards = [event for event in recorder.events if event[0] == "forward"]
    training = [f for f in forwards if f[2]]
    evaluating = [f for f in forwards if not f[2]]
    assert training and evaluating
    assert all(f[1] is True for f in training), "training forward passes must run in model.train() mode"
    assert all(f[1] is False for f in evaluating), "evaluation must run in model.eval() mode without grad"
    # every evaluation batch is gathered with gather_for_metrics (which drops DDP padding)
    sequence = [event for event in recorder.events if event[0] in ("forward", "gather")]
    after_eval_forward = [sequence[i + 1][0] for i, event in enumerate(sequence[:-1]) if event[0] == "forward" and not event[2]]
    assert len(after_eval_forward) == len(evaluating) - (sequence[-1][0] == "forward")
    assert all(kind == "gather" for kind in after_eval_forward)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint(template, tmp_path, monkeypatch, fresh_accelerate, capsys):
    module = load_template(template)
    _, args = TEMPLATES[template]
    output = tmp_path / "run"
    original = torch.nn.functional.cross_entropy
    calls = {"train": 0}

    def poisoned(*a, **k):
        loss = original(*a, **k)
        if torch.is_grad_enabled():
            calls["train"] += 1
            if calls["train"] == 6:  # the 6th training micro-batch
                return loss * math.nan
        return loss

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", poisoned)
    with pytest.raises(SystemExit) as stopped:
        module.main([*args, "--output_dir", str(output), "--tracker", "none", "--resume", "none",
                     "--checkpoint_every_steps", "2"])
    assert stopped.value.code == 3
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("error: non-finite") and "step 6" in message
    kept = sorted(p.name for p in (output / "checkpoints").iterdir())
    assert kept[-1] == "step_00000004", kept  # saved before the bad step; nothing after it
    assert not (output / "model.safetensors").exists()


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_loss_is_accumulated_as_a_python_float(template):
    """`running_loss += loss` would keep every step's autograd graph alive; the templates add `loss.item()`."""
    tree = ast.parse((REPO / "templates" / f"{template}.py").read_text())
    # `running_loss += ...` or `progress.interval_loss_sum += ...` (kept in checkpoints)
    target_name = lambda target: getattr(target, "id", None) or getattr(target, "attr", "")  # noqa: E731
    accumulations = [
        node for node in ast.walk(tree)
        if isinstance(node, ast.AugAssign) and "loss" in target_name(node.target)
    ]
    assert accumulations, "the template should accumulate its training loss for logging"
    for node in accumulations:
        value = node.value
        assert isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "item", (
            f"line {node.lineno}: accumulate loss.item(), not the tensor"
        )


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_clipping_goes_through_the_accelerator(template):
    """accelerator.clip_grad_norm_ unscales fp16 gradients first; torch's own clip would clip scaled ones."""
    source = (REPO / "templates" / f"{template}.py").read_text()
    assert "accelerator.clip_grad_norm_(" in source
    assert "nn.utils.clip_grad_norm_(" not in source and "nn.utils.clip_grad_value_(" not in source
