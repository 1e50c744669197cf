"""The loop and data rules every template follows, checked by running each template in-process and
recording what it does: the order of zero_grad / backward / clip / step, train vs eval mode,
gather_for_metrics in evaluation, non-finite losses stopping the run, loss accumulated as floats;
and what those calls achieve: the gradient norm the optimizer sees, the logged loss, the order of the
training samples epoch by epoch (also across a resume), every validation sample once and in order, a
resume that ends bit-identical, splits that never share a sample (or a token position), the fine-tuning
validation loss recomputed from the export. Every template runs each test (CASES: the fine-tuning one
full and with LoRA). The rules that need two ranks are in test_distributed_rules.py;
scripts/check_rule_tests.py breaks each rule by hand and runs these."""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from conftest import (REPO, assert_one_host_sync_per_ordinary_step, host_syncs_per_step, load_template,
                      reset_accelerate_state, start_clean_accelerate)
from helpers import random_text, read_metrics
from torch.utils.data import Dataset, Subset

import common.accelerator as accelerator_module
import common.data as data_module

sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_model import reverse_task  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One template as these tests run it. A new template (or a variant of one that trains otherwise) is
    covered by every test here with one line in CASES."""

    template: str  # the file in templates/
    watched: str  # the model class whose forward passes are watched: the template's own, or "module:Class"
    args: tuple[str, ...]  # a run of a few optimizer steps; {model} and {data}: the tiny model and its task
    short: dict  # the run of the tests of effects (clipping, the logged loss, fp16): a few steps, 3 logs of 3
    interrupted: tuple[dict, int]  # a run that reaches a second epoch, and the step to stop it at and resume
    export: str = "model.safetensors"  # the exported weights in --output_dir
    libraries: tuple[str, ...] = ()  # libraries whose own host reads are not the loop's (conftest.host_syncs_per_step)


# The tiny Llama of scripts/make_tiny_model.py on 60 reverse-a-word examples (56 for training): 8 micro-batches of 7
# an epoch (so every accumulation window of 2 is full), evaluated every 4 steps and at the end. No greedy answers
# at the evaluations and no sample at the end (their one-prompt forwards are generation, not evaluation batches;
# tests/test_finetune.py covers them), like the language model's --sample_tokens 0.
FINETUNE = ("--model", "{model}", "--data_path", "{data}", "--max_steps", "8", "--eval_every_steps", "4",
            "--batch_size", "7", "--learning_rate", "3e-3", "--warmup_steps", "2", "--sample_tokens", "0",
            "--eval_samples", "0", "--log_every_steps", "2")
LORA = ("--lora_r", "4", "--lora_dropout", "0.1", "--learning_rate", "1e-2")
# Interrupted runs for the shuffle, validation-order and resume tests. Image: 14 micro-batches of 96 an
# epoch, 7 optimizer steps (accumulation 2), stopped at step 9 (epoch 2, 4 micro-batches in). Language
# model: 168 training windows of a random text make 21 micro-batches of 8 an epoch, 11 optimizer steps;
# stopped at step 13 (epoch 2, 4 micro-batches in), 16 steps in all; evaluations at steps 8 and 16.
# Fine-tuning: 8 micro-batches an epoch, 4 optimizer steps; stopped at step 6 (epoch 2, 4 micro-batches in).
FINETUNE_INTERRUPTED = ({"gradient_accumulation_steps": 2}, 6)
CASES = {
    "image_classification": Case(
        "image_classification", "ResNet",
        # 14 batches an epoch, so every accumulation window of 2 is full
        ("--epochs", "2", "--width", "8", "--depth", "1", "--batch_size", "96", "--warmup_steps", "2"),
        short={"epochs": 1}, interrupted=({"gradient_accumulation_steps": 2, "dropout": 0.3}, 9)),
    "language_model": Case(
        "language_model", "GPT",
        ("--max_steps", "12", "--eval_every_steps", "6", "--eval_batches", "2", "--n_layer", "1", "--n_head", "2",
         "--n_embd", "16", "--block_size", "16", "--batch_size", "8", "--warmup_steps", "2", "--dropout", "0.1",
         "--sample_tokens", "0", "--log_every_steps", "2"),
        short={"max_steps": 10, "eval_every_steps": 5},
        interrupted=({"gradient_accumulation_steps": 2, "max_steps": 16, "eval_every_steps": 8, "eval_batches": 4,
                      "data_path": "{corpus}", "dropout": 0.1, "log_every_steps": 4}, 13)),
    "finetune_causal_lm": Case(
        "finetune_causal_lm", "transformers:LlamaForCausalLM", FINETUNE, short={"max_steps": 9},
        interrupted=FINETUNE_INTERRUPTED, export="model/model.safetensors", libraries=("transformers",)),
    "finetune_causal_lm_lora": Case(
        "finetune_causal_lm", "transformers:LlamaForCausalLM", (*FINETUNE, *LORA),
        short={"max_steps": 9}, interrupted=FINETUNE_INTERRUPTED,
        export="model/adapter_model.safetensors", libraries=("transformers",)),
}


@pytest.fixture(scope="session")
def finetune_inputs(tiny_model, tmp_path_factory) -> dict[str, str]:
    """What the fine-tuning cases' {model} and {data} name: the tiny model, and a reverse-a-word task for it."""
    data = tmp_path_factory.mktemp("finetune") / "reverse.jsonl"
    data.write_text("".join(json.dumps(example) + "\n" for example in reverse_task(60)))
    return {"model": str(tiny_model), "data": str(data)}


@dataclass(frozen=True)
class Resolved:
    name: str
    spec: Case
    module: object  # the template, imported
    args: tuple[str, ...]  # spec.args with {model} and {data} filled in

    def model_class(self) -> type:
        if ":" not in self.spec.watched:
            return getattr(self.module, self.spec.watched)
        library, name = self.spec.watched.split(":")
        return getattr(importlib.import_module(library), name)


def resolve(name: str, request) -> Resolved:
    """CASES[name] ready to run; the tiny model and its data are written (once a session) for the cases using them."""
    spec = CASES[name]
    needs = any("{" in arg for arg in spec.args)
    inputs = request.getfixturevalue("finetune_inputs") if needs else {}
    return Resolved(name, spec, load_template(spec.template), tuple(arg.format(**inputs) for arg in spec.args))


@pytest.fixture
def case(template, request) -> Resolved:
    """The case the test's `template` parameter names."""
    return resolve(template, request)


def mode(model: torch.nn.Module) -> bool | str:
    """True when the model and every module in it are in training mode, False when none is; else "mixed" (a LoRA
    adapter's dropout left in eval mode in a model put back into training mode, say)."""
    modes = {module.training for module in model.modules()}
    return modes.pop() if len(modes) == 1 else "mixed"


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

        real_zero_grad = torch.optim.AdamW.zero_grad

        @functools.wraps(real_zero_grad)
        def zero_grad(optimizer, set_to_none=True):
            result = real_zero_grad(optimizer, set_to_none=set_to_none)
            # the effect: every gradient freed (None), not a tensor of zeros that is then added to
            freed = all(p.grad is None for group in optimizer.param_groups for p in group["params"])
            record(("zero_grad", set_to_none, freed))
            return result

        monkeypatch.setattr(torch.optim.AdamW, "zero_grad", zero_grad)
        wrap(torch.optim.AdamW, "step", lambda self, *a, **k: ("step",))
        wrap(Accelerator, "backward", lambda self, loss, **k: ("backward",))
        wrap(Accelerator, "clip_grad_norm_", lambda self, *a, **k: ("clip",))
        wrap(Accelerator, "gather_for_metrics", lambda self, *a, **k: ("gather",))
        wrap(model_class, "forward", lambda self, *a, **k: ("forward", mode(self), torch.is_grad_enabled()))

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


@pytest.mark.parametrize("template", sorted(CASES))
@pytest.mark.parametrize("accumulation", [1, 2])
def test_step_order_zero_grad_backward_clip_step(case, accumulation, tmp_path, monkeypatch, fresh_accelerate):
    recorder = Recorder(monkeypatch, case.model_class())
    case.module.main([*case.args, "--output_dir", str(tmp_path / "run"), "--tracker", "none",
                      "--gradient_accumulation_steps", str(accumulation), "--resume", "none"])

    windows = recorder.windows()
    assert len(windows) >= 4, "the run should take several optimizer steps"
    done, epoch_length = 0, None  # micro-batches so far; those of an epoch, known at its first short window
    for window in windows:
        # zero_grad(set_to_none=True) opens the step, then one backward per micro-batch,
        # clipping after the last backward, then the optimizer step.
        backwards = window.count("backward")
        assert window == ["zero_grad"] + ["backward"] * backwards + ["clip", "step"], window
        done += backwards
        if backwards != accumulation:  # accelerate also steps at an epoch's end that leaves the window short
            epoch_length = epoch_length or done
            assert 0 < backwards < accumulation < epoch_length and done % epoch_length == 0, (windows, epoch_length)
    assert all(event[1] is True and event[2] for event in recorder.events if event[0] == "zero_grad")


@pytest.mark.parametrize("template", sorted(CASES))
def test_train_and_eval_modes(case, tmp_path, monkeypatch, fresh_accelerate):
    recorder = Recorder(monkeypatch, case.model_class())
    case.module.main([*case.args, "--output_dir", str(tmp_path / "run"), "--tracker", "none", "--resume", "none"])

    forwards = [event for event in recorder.events if event[0] == "forward"]
    training = [f for f in forwards if f[2]]
    evaluating = [f for f in forwards if not f[2]]
    assert training and evaluating
    assert all(f[1] is True for f in training), "training forward passes must run in model.train() mode"
    assert all(f[1] is False for f in evaluating), "evaluation must run in model.eval() mode without grad"
    # every evaluation batch is gathered with gather_for_metrics (which drops DDP padding)
    sequence = [event for event in recorder.events if event[0] in ("forward", "gather")]
    after_eval_forward = [sequence[i + 1][0] for i, event in enumerate(sequence[:-1])
                          if event[0] == "forward" and not event[2]]
    assert len(after_eval_forward) == len(evaluating) - (sequence[-1][0] == "forward")
    assert all(kind == "gather" for kind in after_eval_forward)


@pytest.mark.parametrize("template", sorted(CASES))
def test_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint(case, tmp_path, monkeypatch, fresh_accelerate,
                                                                      capsys):
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
        case.module.main([*case.args, "--output_dir", str(output), "--tracker", "none", "--resume", "none",
                          "--checkpoint_every_steps", "2"])
    assert stopped.value.code == 3
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("error: non-finite") and "step 6" in message
    kept = sorted(p.name for p in (output / "checkpoints").iterdir())
    assert kept[-1] == "step_00000004", kept  # saved before the bad step; nothing after it
    assert not (output / case.spec.export).exists() and not (output / "model").exists()


@pytest.mark.parametrize("template", sorted(CASES))
def test_no_autograd_graph_survives_the_step(case, tmp_path, monkeypatch, fresh_accelerate):
    """`interval_loss_sum += loss` would keep every micro-batch's autograd graph (and its activations) alive
    until the next log; `TrainingState.count_micro_batch` adds the loss detached (the fine-tuning template its
    step's detached sums). Checked on the training state after every optimizer step: nothing in it may hold a graph."""
    from common.checkpoint import CheckpointManager

    held: list[tuple[int, str]] = []
    real_save_if_due = CheckpointManager.save_if_due

    def save_if_due(self, state):  # called once after every optimizer step
        held.extend((state.step, name) for name, value in vars(state).items()
                    if isinstance(value, torch.Tensor) and (value.requires_grad or value.grad_fn is not None))
        return real_save_if_due(self, state)

    monkeypatch.setattr(CheckpointManager, "save_if_due", save_if_due)
    case.module.main([*case.args, "--output_dir", str(tmp_path / "run"), "--tracker", "none", "--resume", "none",
                      "--log_every_steps", "1000"])
    assert held == [], f"(step, field) holding an autograd graph: {held[:5]}"


@pytest.mark.parametrize("template", sorted({case.template for case in CASES.values()}))
def test_clipping_goes_through_the_accelerator(template):
    """accelerator.clip_grad_norm_ unscales fp16 gradients first; torch's own clip would clip scaled ones."""
    source = (REPO / "templates" / f"{template}.py").read_text()
    assert "accelerator.clip_grad_norm_(" in source
    assert "nn.utils.clip_grad_norm_(" not in source and "nn.utils.clip_grad_value_(" not in source


# --- effects, not calls ------------------------------------------------------------------------------
# The tests above check that the right calls happen in the right order. The ones below check what the
# calls achieve, so that a call made in the wrong way (clipping while the gradients are still scaled,
# a shuffle that ignores the epoch, an overlapping split, ...) fails too.

def options(case: Resolved, **overrides) -> list[str]:
    """The case's tiny arguments with some replaced or added; every option given once."""
    base = case.args
    values = dict(zip(base[::2], base[1::2]))
    values.update({f"--{key}": str(value) for key, value in overrides.items()})
    return [item for pair in values.items() for item in pair]


def run_main(case: Resolved, output: Path, **overrides):
    """One in-process run (a new job: accelerate's singletons reset), without W&B."""
    reset_accelerate_state()
    overrides.setdefault("resume", "none")
    return case.module.main(options(case, output_dir=output, tracker="none", **overrides))


def grad_norm(params) -> float:
    """The total 2-norm of the gradients, in float64."""
    norms = [torch.linalg.vector_norm(p.grad.detach().double()) for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0


def attach_fp16_scaler(monkeypatch, init_scale: float) -> None:
    """fp16 on the CPU as accelerate sets it up on a GPU without bf16: a loss scaler that the optimizer
    wrapper steps and that clip_grad_norm_ unscales with (as tests/fault_inject.py does)."""
    real_build = accelerator_module.build_accelerator  # start_run builds the Accelerator through it

    def build(**kwargs):
        accelerator = real_build(**kwargs)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=10**6)
        accelerator.native_amp = True
        accelerator.state._mixed_precision = "fp16"
        return accelerator

    monkeypatch.setattr(accelerator_module, "build_accelerator", build)


class GradNorms:
    """The true gradient norm after each backward (unscaled, as the loss scaler's scale is known) and the
    norm of the gradients the optimizer is handed at each step."""

    def __init__(self, monkeypatch):
        self.after_backward: list[float] = []
        self.steps: list[tuple[float, float]] = []  # (norm before clipping, norm the optimizer sees)
        real_backward, real_step = Accelerator.backward, torch.optim.AdamW.step

        @functools.wraps(real_backward)
        def backward(accelerator, loss, **kwargs):
            result = real_backward(accelerator, loss, **kwargs)
            params = [p for optimizer in accelerator._optimizers for g in optimizer.param_groups for p in g["params"]]
            scale = accelerator.scaler.get_scale() if accelerator.scaler is not None else 1.0
            self.after_backward.append(grad_norm(params) / scale)
            return result

        @functools.wraps(real_step)
        def step(optimizer, *args, **kwargs):
            seen = grad_norm(p for group in optimizer.param_groups for p in group["params"])
            self.steps.append((self.after_backward[-1], seen))
            return real_step(optimizer, *args, **kwargs)

        monkeypatch.setattr(Accelerator, "backward", backward)
        monkeypatch.setattr(torch.optim.AdamW, "step", step)


@pytest.mark.parametrize("template", sorted(CASES))
@pytest.mark.parametrize("precision", ["fp32", "fp16-scaler"])
def test_the_optimizer_sees_gradients_clipped_to_grad_clip(case, precision, tmp_path, monkeypatch, fresh_accelerate):
    """Not only that clipping is called: the norm of the gradients the optimizer steps with is --grad_clip
    (when they were larger), also under a loss scaler, where clipping the still-scaled gradients would
    leave them grad_clip / scale after unscaling."""
    if precision == "fp16-scaler":
        attach_fp16_scaler(monkeypatch, init_scale=2.0**10)
    norms = GradNorms(monkeypatch)
    clip = 1e-3
    run_main(case, tmp_path / "run", grad_clip=clip, gradient_accumulation_steps=2, **case.spec.short)
    assert len(norms.steps) >= 4
    for number, (before, seen) in enumerate(norms.steps, 1):
        assert before > 10 * clip, f"step {number}: the gradients were small enough already ({before})"
        assert seen <= clip * (1 + 1e-6), f"step {number}: the optimizer saw a gradient norm of {seen} > {clip}"
        assert seen == pytest.approx(clip, rel=1e-4), f"step {number}: gradients clipped to {seen}, not {clip}"


@pytest.mark.parametrize("template", sorted(CASES))
def test_logged_training_loss_is_the_float_mean_of_its_micro_batches(case, tmp_path, monkeypatch, fresh_accelerate):
    """What is logged is a Python float, the mean of the micro-batch losses since the last log (summed on
    the device in float32, so equal to the float mean up to float32 rounding). A template whose loss is a sum
    over target tokens (fine-tuning: every token of a step weighs the same) logs the mean over those tokens."""
    from common.tracking import Tracker

    losses, logged = [], []  # (loss, what it weighs: its target tokens if a sum, else 1) per training micro-batch
    real_cross_entropy, real_log = torch.nn.functional.cross_entropy, Tracker.log

    def cross_entropy(*args, **kwargs):
        loss = real_cross_entropy(*args, **kwargs)
        if torch.is_grad_enabled():  # training micro-batches only
            targets = args[1] if len(args) > 1 else kwargs["target"]
            summed = kwargs.get("reduction", "mean") == "sum"
            losses.append((loss.item(), (targets != kwargs.get("ignore_index", -100)).sum().item() if summed else 1))
        return loss

    def log(self, metrics, step):
        logged.append((step, dict(metrics)))
        return real_log(self, metrics, step)

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", cross_entropy)
    monkeypatch.setattr(Tracker, "log", log)
    run_main(case, tmp_path / "run", log_every_steps=3, **case.spec.short)  # a micro-batch per step
    records = [(step, metrics["train/loss"]) for step, metrics in logged if "train/loss" in metrics]
    assert len(records) >= 3
    previous = 0
    for step, value in records:
        interval = losses[previous:step]
        assert type(value) is float, f"step {step}: logged {type(value).__name__}, not float"
        assert value == pytest.approx(sum(loss for loss, _ in interval) / sum(weight for _, weight in interval),
                                      rel=1e-6), step
        previous = step


class Recording(Dataset):
    """The dataset a loader is given, recording each index it is asked for (workers: none, so in order)."""

    def __init__(self, dataset, log: list[int]):
        self.dataset, self.log = dataset, log

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        self.log.append(index)
        return self.dataset[index]


class DataWatch:
    """What one in-process run trains and evaluates on, as indices into the datasets its loaders get.

    accelerate's loader fetches one batch ahead, so of the indices fetched for training only the first
    (micro-batches trained) x batch size were trained on; batches are trained in the order fetched.
    """

    def __init__(self, monkeypatch, module):
        self.train_sets, self.val_sets, self.fetched, self.val_fetched = [], [], [], []
        self.batches_per_epoch, self.evaluations = 0, 0
        real_build, real_backward, real_evaluate = data_module.build_loader, Accelerator.backward, module.evaluate

        def build_loader(dataset, **kwargs):
            (self.train_sets if kwargs["train"] else self.val_sets).append(dataset)
            return real_build(Recording(dataset, self.fetched if kwargs["train"] else self.val_fetched), **kwargs)

        @functools.wraps(real_backward)
        def backward(accelerator, loss, **kwargs):
            self.batches_per_epoch += 1
            return real_backward(accelerator, loss, **kwargs)

        def evaluate(*args, **kwargs):
            self.evaluations += 1
            return real_evaluate(*args, **kwargs)

        monkeypatch.setattr(data_module, "build_loader", build_loader)
        monkeypatch.setattr(Accelerator, "backward", backward)
        monkeypatch.setattr(module, "evaluate", evaluate)

    def trained(self, batch_size: int) -> list[int]:
        return self.fetched[: self.batches_per_epoch * batch_size]


@pytest.fixture(scope="module", params=sorted(CASES))
def interrupted_runs(request, tmp_path_factory):
    """Per case: one uninterrupted run and one stopped mid-epoch 2 and resumed, each watched by DataWatch."""
    case = resolve(request.param, request)
    root = tmp_path_factory.mktemp(f"runs-{case.name}")
    overrides, stop = case.spec.interrupted
    corpus = random_text(root / "corpus.txt", 3000, seed=0)
    overrides = {k: str(v).format(corpus=corpus) for k, v in overrides.items()}
    watches = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        start_clean_accelerate(monkeypatch)
        for name, sessions in (("uninterrupted", [{}]),
                               ("interrupted", [{"stop_after_steps": stop}, {"resume": "auto"}])):
            for number, extra in enumerate(sessions):
                with pytest.MonkeyPatch.context() as watching:
                    watches.setdefault((name, number), DataWatch(watching, case.module))
                    run_main(case, root / name, **overrides, **extra)
    reset_accelerate_state()
    batch_size = int(options(case)[options(case).index("--batch_size") + 1])
    return SimpleNamespace(case=case, root=root, watches=watches, batch_size=batch_size, seed=0)


def planned_order(train_set_size: int, micro_batches_per_epoch: int, batch_size: int, seed: int, samples: int):
    """The training order that seed + epoch fixes: epoch e is a permutation from a generator seeded with
    seed + e, less the incomplete last batch; `samples` of them in all."""
    order = []
    for epoch in itertools.count():
        permutation = torch.randperm(train_set_size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        order += permutation[: micro_batches_per_epoch * batch_size]
        if len(order) >= samples:
            return order[:samples]


def test_each_epoch_has_the_shuffle_that_seed_and_epoch_fix_also_after_a_resume(interrupted_runs):
    """set_epoch: accelerate's sampler moves to the next epoch by itself in a loop that never stops, so only
    a resume into a later epoch shows a missing set_epoch. Both runs must train on the order seed + epoch
    gives, epoch by epoch (a different one each epoch), the resumed one continuing it mid-epoch."""
    runs, batch_size = interrupted_runs, interrupted_runs.batch_size
    whole = runs.watches[("uninterrupted", 0)]
    (train_set,) = whole.train_sets
    n = len(train_set)
    per_epoch = n // batch_size  # one process: every full batch, the last partial one dropped
    trained = whole.trained(batch_size)
    planned = planned_order(n, per_epoch, batch_size, runs.seed, len(trained))
    assert len(trained) > per_epoch * batch_size, "the run should reach a second epoch"
    first, second = planned[: per_epoch * batch_size], planned[per_epoch * batch_size:]
    assert first[: len(second)] != second and sorted(first) != first
    assert trained[: len(first)] == first, "epoch 1 is not the order seed + 0 gives"
    assert trained[len(first):] == second, "epoch 2 is not the order seed + 1 gives"
    before, after = runs.watches[("interrupted", 0)], runs.watches[("interrupted", 1)]
    assert len(before.trained(batch_size)) > per_epoch * batch_size  # stopped in the second epoch ...
    resumed = before.trained(batch_size) + after.trained(batch_size)
    assert resumed[: len(first)] == first
    assert resumed[len(first):] == second, "after the resume, epoch 2 does not continue the order seed + 1 gives"


def test_every_evaluation_sees_each_validation_sample_once_in_order(interrupted_runs):
    for (name, session), watch in interrupted_runs.watches.items():
        (val_set,) = watch.val_sets
        assert watch.evaluations >= 1
        assert watch.val_fetched == list(range(len(val_set))) * watch.evaluations, (name, session)


def test_resumed_run_ends_bit_identical_in_process(interrupted_runs):
    """The whole state is in the checkpoint: RNG streams (dropout, augmentation), scheduler, data position."""
    from safetensors.torch import load_file

    export = interrupted_runs.case.spec.export
    whole = load_file(str(interrupted_runs.root / "uninterrupted" / export))
    resumed = load_file(str(interrupted_runs.root / "interrupted" / export))
    assert sorted(whole) == sorted(resumed)
    assert [key for key in whole if not torch.equal(whole[key], resumed[key])] == []


# --- what the templates' loaders hold --------------------------------------------------------------

class Built(BaseException):
    """Ends a run once its loaders are built (a BaseException: no handler in the template turns it into an exit)."""


def built_loaders(monkeypatch, case: Resolved, output: Path, **overrides) -> dict[bool, tuple]:
    """{train: (dataset, loader)} as the template builds them, before it prepares them; the run stops there."""
    built, real_build = {}, data_module.build_loader

    def build_loader(dataset, **kwargs):
        built[kwargs["train"]] = (dataset, real_build(dataset, **kwargs))
        if len(built) == 2:
            raise Built
        return built[kwargs["train"]][1]

    monkeypatch.setattr(data_module, "build_loader", build_loader)
    with pytest.raises(Built):
        run_main(case, output, **overrides)
    return built


def sample_keys(dataset) -> set:
    """What identifies a sample's content: images by their pixels' bytes, fine-tuning examples by their tokens."""
    keys = set()
    for index in range(len(dataset)):
        first, _ = dataset[index]
        keys.add(first.numpy().tobytes() if isinstance(first, torch.Tensor) else tuple(first))
    return keys


class Streams:
    """Where each token of the language model's streams comes from: a text stream is the bytes of the files
    that read_text_files joined (recorded as the template reads them), a token file is itself."""

    def __init__(self, monkeypatch, module):
        self.read: dict[int, tuple[np.ndarray, list[tuple[str, int]]]] = {}  # id(stream) -> (stream, its files)
        real_read = module.read_text_files

        def read_text_files(files):
            stream = real_read(files)
            self.read[id(stream)] = (stream, [(str(f.resolve()), f.stat().st_size) for f in files])
            return stream

        monkeypatch.setattr(module, "read_text_files", read_text_files)

    def tokens(self, windows) -> np.ndarray:
        return windows.tokens if isinstance(windows.tokens, np.ndarray) else np.fromfile(windows.tokens, np.uint16)

    def origin(self, windows, position: int) -> tuple[str, int]:
        """(file, offset in it) of a position of the stream `windows` reads."""
        if not isinstance(windows.tokens, np.ndarray):
            return str(Path(windows.tokens).resolve()), position
        _, files = self.read[id(windows.tokens)]
        for name, length in files:
            if position < length:
                return name, position
            position -= length
        raise AssertionError("a position past the end of its stream")

    def positions(self, dataset) -> list[list[tuple[str, int]]]:
        """Per window of `dataset` (TokenWindows or a Subset of them): the origins of the tokens it reads, its
        inputs and last target, after checking that what it returns is the stream at those positions."""
        windows, indices = (dataset.dataset, dataset.indices) if isinstance(dataset, Subset) else \
            (dataset, range(len(dataset)))
        stream, size = self.tokens(windows), windows.block_size
        read = []
        for index in indices:
            begin = windows.start + index * size
            inputs, targets = windows[index]
            assert torch.cat([inputs, targets[-1:]]).tolist() == stream[begin:begin + size + 1].tolist(), index
            read.append([self.origin(windows, p) for p in range(begin, begin + size + 1)])
        return read


def random_images(root: Path, classes: int = 2, per_class: int = 15) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in range(classes):
        (root / f"class{label}").mkdir(parents=True)
        for index in range(per_class):
            pixels = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class{label}" / f"{index:03d}.png")
    return root


def random_tokens(path: Path, count: int) -> Path:
    np.random.default_rng(1).integers(0, 60000, size=count, dtype=np.uint16).tofile(path)
    return path


def random_text_folder(root: Path, files: int = 12) -> Path:
    root.mkdir()
    for index in range(files):
        random_text(root / f"part{index:02d}.txt", 600, seed=10 + index)
    return root


SPLIT_CASES = {
    # split -> (case of CASES, options; {tmp} is the test's folder, made by the function named in DATA)
    "digits": ("image_classification", {}),
    "image-folder": ("image_classification", {"data_dir": "{tmp}/images", "image_size": 8, "batch_size": 4,
                                              "val_fraction": 0.3, "num_workers": 0}),
    "text-file": ("language_model", {"data_path": "{tmp}/corpus.txt"}),
    "text-folder": ("language_model", {"data_path": "{tmp}/texts", "val_fraction": 0.3}),
    "token-file": ("language_model", {"data_path": "{tmp}/tokens.bin"}),
    "finetune-jsonl": ("finetune_causal_lm", {}),
}
DATA = {
    "image-folder": lambda tmp: random_images(tmp / "images"),
    "text-file": lambda tmp: random_text(tmp / "corpus.txt", 3000, seed=0),
    "text-folder": lambda tmp: random_text_folder(tmp / "texts"),
    "token-file": lambda tmp: random_tokens(tmp / "tokens.bin", 3000),
}


@pytest.mark.parametrize("split", list(SPLIT_CASES))
def test_template_trains_and_evaluates_on_disjoint_samples(split, tmp_path, monkeypatch, fresh_accelerate, request):
    """No sample the template trains on is among those it evaluates on: checked on the datasets its loaders
    get, not only on the split function's indices. Images and fine-tuning examples by their content; the
    language model's windows by the positions they read in the files: no token a validation window reads is
    inside a training window, however few they share."""
    name, overrides = SPLIT_CASES[split]
    if split in DATA:
        DATA[split](tmp_path)
    case = resolve(name, request)
    streams = Streams(monkeypatch, case.module) if case.spec.template == "language_model" else None
    overrides = {key: str(value).format(tmp=tmp_path) for key, value in overrides.items()}
    built = built_loaders(monkeypatch, case, tmp_path / "run", **overrides)
    (train_set, _), (val_set, _) = built[True], built[False]
    assert len(train_set) > 0 and len(val_set) > 0
    if streams is None:
        train_keys, val_keys = sample_keys(train_set), sample_keys(val_set)
        assert len(val_keys) > 0
        shared = train_keys & val_keys
        assert not shared, f"{len(shared)} validation samples are also trained on"
        return
    trained = {origin for window in streams.positions(train_set) for origin in window}
    inside = [(index, sorted(set(window) & trained)[:3]) for index, window in enumerate(streams.positions(val_set))
              if not trained.isdisjoint(window)]
    assert not inside, f"{len(inside)} validation windows read tokens of training windows (window, positions): " \
                       f"{inside[:3]}"


@pytest.mark.parametrize("template", sorted(CASES))
def test_template_loaders_shuffle_and_drop_only_for_training_and_never_pin_on_cpu(case, tmp_path, monkeypatch,
                                                                                   fresh_accelerate):
    from torch.utils.data import RandomSampler, SequentialSampler

    built = built_loaders(monkeypatch, case, tmp_path / "run", num_workers=1)
    train, val = built[True][1], built[False][1]
    assert isinstance(train.sampler, RandomSampler) and train.drop_last is True
    assert isinstance(val.sampler, SequentialSampler) and val.drop_last is False
    for loader in (train, val):
        assert loader.pin_memory is False  # no GPU here: pinning would only cost
        assert loader.num_workers == 1 and loader.persistent_workers is True and loader.worker_init_fn is not None


@pytest.mark.parametrize("template", sorted(CASES))
def test_fp16_overflow_is_skipped_by_the_scaler_not_fatal(case, tmp_path, monkeypatch, fresh_accelerate):
    """Under fp16 a non-finite loss is the loss scaler's business: the step is skipped (and counted), the
    run goes on; only without a scaler does it stop the run (test_non_finite_loss_stops_the_run...)."""
    from common.tracking import Tracker

    attach_fp16_scaler(monkeypatch, init_scale=2.0**10)
    real_cross_entropy, real_log, real_step = torch.nn.functional.cross_entropy, Tracker.log, torch.optim.AdamW.step
    calls, logged = {"train": 0, "steps": 0}, []

    def cross_entropy(*args, **kwargs):
        loss = real_cross_entropy(*args, **kwargs)
        if torch.is_grad_enabled():
            calls["train"] += 1
            if calls["train"] == 3:
                return loss * math.inf
        return loss

    @functools.wraps(real_step)
    def step(optimizer, *args, **kwargs):
        calls["steps"] += 1
        return real_step(optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", cross_entropy)
    monkeypatch.setattr(Tracker, "log", lambda self, metrics, step: logged.append(metrics) or real_log(self, metrics,
                                                                                                 step))
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    run_main(case, tmp_path / "run", log_every_steps=1, **case.spec.short)
    skipped = [metrics["train/skipped_steps"] for metrics in logged if "train/skipped_steps" in metrics]
    assert skipped[-1] == 1 and (tmp_path / "run" / case.spec.export).is_file()
    assert calls["steps"] == len(skipped) - 1  # every optimizer step but the overflowing one was taken


# --- what evaluation reports ------------------------------------------------------------------------

@pytest.mark.parametrize("template", [name for name, spec in CASES.items() if spec.template == "finetune_causal_lm"])
def test_finetune_validation_loss_is_the_exported_models_mean_over_completion_tokens(case, tmp_path, monkeypatch,
                                                                                     fresh_accelerate, finetune_inputs):
    """The last logged val/loss, recomputed without the template: the exported model (loaded as a user would)
    on each validation example alone, unpadded, its loss summed over the tokens the example learns and divided
    by their number, not by all its tokens (the prompt's are predicted too, but not learned)."""
    from transformers import AutoModelForCausalLM

    watch = DataWatch(monkeypatch, case.module)  # the validation examples the run was given
    run_main(case, tmp_path / "run", max_steps=4, eval_every_steps=0)
    logged = [line for line in read_metrics(tmp_path / "run") if "val/loss" in line][-1]
    assert logged["step"] == 4
    export = tmp_path / "run" / "model"
    if (export / "adapter_config.json").is_file():
        from peft import PeftModel

        with warnings.catch_warnings():  # peft asks the model's deprecated `is_gradient_checkpointing`
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(finetune_inputs["model"]), export)
    else:
        model = AutoModelForCausalLM.from_pretrained(export)
    (val_set,) = watch.val_sets
    total, learned, predicted = 0.0, 0, 0
    with torch.no_grad():
        for index in range(len(val_set)):
            input_ids, labels = val_set[index]
            logits = model.eval()(input_ids=torch.tensor([input_ids])).logits[0].double()
            log_probs = torch.log_softmax(logits[:-1], dim=-1)
            for position, label in enumerate(labels[1:]):
                predicted += 1
                if label != -100:
                    total -= log_probs[position, label].item()
                    learned += 1
    assert 0 < learned < predicted and logged["val/tokens"] == learned
    assert logged["val/loss"] == pytest.approx(total / learned, rel=1e-5)
    assert total / predicted < 0.9 * logged["val/loss"]  # what counting every token would have logged


# --- host syncs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("template", sorted(CASES))
@pytest.mark.parametrize("accumulation", [1, 4])
def test_at_most_one_host_sync_per_optimizer_step(case, accumulation, tmp_path, monkeypatch, fresh_accelerate):
    """On a GPU every read of a device value on the host drains the launch queue. Outside the steps that
    log, evaluate or checkpoint, an optimizer step may read one: the fused finiteness / stop-signal check.
    A library's own reads (transformers reads the padding mask in each forward, to skip building the mask
    when nothing is padded) are not the loop's and are not counted."""
    windows = host_syncs_per_step(monkeypatch, libraries=case.spec.libraries)
    quiet = ["--log_every_steps", "1000", "--checkpoint_every_steps", "0"]
    quiet += ["--eval_every_steps", "0"] if "--eval_every_steps" in case.args else []
    case.module.main([*case.args, *quiet, "--output_dir", str(tmp_path / "run"), "--tracker", "none",
                      "--resume", "none", "--gradient_accumulation_steps", str(accumulation)])

    assert_one_host_sync_per_ordinary_step(windows)


# --- where the time goes ---------------------------------------------------------------------------

class SlowDataset(Dataset):
    """A dataset whose samples take `seconds` each to load, like images decoded from a slow disk."""

    def __init__(self, dataset, seconds: float):
        self.dataset, self.seconds = dataset, seconds

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        time.sleep(self.seconds)
        return self.dataset[index]


@pytest.mark.parametrize("slow", [False, True], ids=["default-data", "slow-data"])
def test_data_wait_and_step_time_are_logged_and_a_slow_loader_is_named(slow, tmp_path, monkeypatch, fresh_accelerate,
                                                                       capsys):
    module = load_template("image_classification")
    if slow:
        real_load = module.load_datasets

        def load_datasets(cfg):
            data = real_load(cfg)
            # 1 s per batch of 20, against milliseconds of training: loading dominates even on a busy machine
            data.train = SlowDataset(Subset(data.train, range(200)), 0.05)
            return data

        monkeypatch.setattr(module, "load_datasets", load_datasets)
    tiny = ["--batch_size", "20", "--width", "8", "--depth", "1"] if slow else []  # default data: default model
    module.main(["--epochs", "1", *tiny, "--log_every_steps", "2", "--num_workers", "0",
                 "--output_dir", str(tmp_path / "run"), "--tracker", "none", "--resume", "none"])
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [line for line in lines if "time/data_wait" in line]
    assert len(logged) >= 3
    assert all(0 <= line["time/data_wait"] < 1 and line["time/step_ms"] > 0 for line in logged), logged
    waits = [line["time/data_wait"] for line in logged]
    # accelerate's loader fetches one batch ahead: an epoch's last batch is waited for in the interval before
    median = sorted(waits)[len(waits) // 2]
    assert (median > 0.5) if slow else (median < 0.1), waits
    warnings = [line for line in capsys.readouterr().out.splitlines() if "waited for data" in line]
    assert len(warnings) == (1 if slow else 0), warnings  # once, however long it lasts
    if slow:
        assert "--num_workers (now 0)" in warnings[0]
