"""Which options a resume may change, tried option by option on every template, generated from each `Config`.

A checkpoint resumes only the run that wrote it: `CheckpointManager` compares the settings the checkpoint
recorded with the new ones, and the options a resume may change are those declared
`option(..., may_change=True)` (in `common.config.RunOptions` or the template's `Config`). For every option of
every template, a resume with another value is refused in one `error:` line, exit 2 and nothing written,
unless the option is one of the may-change options pinned below, which are accepted; the option that sets the
run's length may grow, not shrink. A new option is covered by its declaration alone (refused unless declared
may-change); declaring an option may-change fails here until it is added to the pinned list on purpose.

In-process and cheap: the comparison happens before anything is loaded, so a tiny model's checkpoint written
under each template's name and default settings stands for a real run's. The manager is built by `for_run`,
as the templates build it, and the refusal goes through `with_exit_codes`, as in the templates' `main`.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest
import torch

from common.accelerator import build_accelerator
from common.checkpoint import CheckpointManager, TrainingState
from common.config import _unwrap_optional, may_change_on_resume
from common.errors import with_exit_codes
from common.optim import warmup_cosine
from conftest import REPO, load_template
from helpers import snapshot

# Where and how long a session runs, how it reports and how often it saves: the same for every template.
SHARED = {"resume", "output_dir", "stop_after_steps", "num_workers", "timeout_s", "tracker", "wandb_project",
          "log_every_steps", "checkpoint_every_steps", "keep_last", "checkpoint_background"}
MAY_CHANGE = {  # how the run is watched or how fast it runs, not what it trains
    "image_classification": SHARED,
    "language_model": SHARED | {"eval_every_steps", "sample_tokens", "prompt", "temperature", "peak_tflops",
                                "compile", "activation_checkpointing"},
    "finetune_causal_lm": SHARED | {"eval_every_steps", "sample_tokens", "prompt", "compile",
                                    "gradient_checkpointing", "merge_lora", "export_from", "eval_samples"},
}
LENGTH = {"image_classification": "epochs", "language_model": "max_steps", "finetune_causal_lm": "max_steps"}


def other_values(base, field: dataclasses.Field) -> list:
    """Values of `field` other than `base`'s that its range (and the Config's own checks) allow, in the order tried."""
    value = getattr(base, field.name)
    kind, _ = _unwrap_optional(typing.get_type_hints(type(base))[field.name])
    allowed = field.metadata.get("range")
    if isinstance(allowed, tuple):
        candidates = [choice for choice in allowed if choice != value]
    elif kind is bool:
        candidates = [not value]
    elif kind is int:
        candidates = [value + 1, value - 1, value * 2, value // 2]
    elif kind is float:
        candidates = [value * 2, value / 2, value + 0.5, (value + 1) / 2]
    elif kind is str:
        candidates = ["other" if value is None else f"{value}-other", "none"]  # "none": a choice such as --tracker
    else:  # a list
        candidates = [[*value, "other"]]
    valid = []
    for candidate in candidates:
        try:
            dataclasses.replace(base, **{field.name: candidate})
        except ValueError:  # out of its range, or against another option (n_embd a multiple of n_head)
            continue
        if candidate != value:
            valid.append(candidate)
    return valid


@pytest.mark.parametrize("template", list(MAY_CHANGE))
def test_the_options_a_resume_may_change_are_declared_on_them(template):
    config = load_template(template).Config
    assert may_change_on_resume(config) == MAY_CHANGE[template]
    # The length option passed to the manager here is the template's own.
    assert f'length="{LENGTH[template]}"' in (REPO / "templates" / f"{template}.py").read_text()


@pytest.mark.parametrize("template", list(MAY_CHANGE))
def test_every_option_refuses_a_resume_with_another_value_unless_it_may_change(template, tmp_path, fresh_accelerate,
                                                                               capsys):
    config = load_template(template).Config
    run = tmp_path / "run"
    base = config(output_dir=str(run))
    accelerator = build_accelerator(seed=0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator.prepare(model, optimizer, warmup_cosine(optimizer, 2, 20))

    def manager(cfg) -> CheckpointManager:
        return CheckpointManager.for_run(accelerator, cfg, template=template, metric="val/loss", mode="min",
                                         length=LENGTH[template])

    first = manager(base)
    first.resume("none")
    checkpoint = first.save(TrainingState(step=1), wait=True)

    cases = []  # (option, value, accepted)
    for field in dataclasses.fields(config):
        values = other_values(base, field)
        assert values, f"--{field.name}: no other valid value found to try"
        if field.name == LENGTH[template]:  # longer: the run is extended; shorter: another run
            old = getattr(base, field.name)
            cases += [(field.name, max(values), True), (field.name, min(values), min(values) > old)]
        else:
            cases.append((field.name, values[0], field.name in MAY_CHANGE[template]))
    assert len({name for name, _, _ in cases}) == len(dataclasses.fields(config))

    wrong = []
    for name, value, accepted in cases:
        cfg = dataclasses.replace(base, **{name: value})
        capsys.readouterr()
        before = snapshot(run)
        if accepted:
            try:
                state = manager(cfg).resume(str(checkpoint))
            except Exception as error:  # noqa: BLE001 (every option's outcome is reported at the end)
                wrong.append(f"--{name} {value!r} was refused: {error}")
                continue
            if state.step != 1:
                wrong.append(f"--{name} {value!r}: resumed at step {state.step}, not 1")
            continue
        try:
            with_exit_codes(manager(cfg).resume)(str(checkpoint))
            code = None
        except SystemExit as exit_info:
            code = exit_info.code
        lines = capsys.readouterr().err.splitlines()
        shown = f"--{name} {json.dumps(getattr(base, name))} there, {json.dumps(value)} now"
        expected = f"error: checkpoint {checkpoint} belongs to a run with other settings: {shown}. "
        if code is None:
            wrong.append(f"--{name} {value!r} was accepted")
        elif code != 2 or len(lines) != 1 or not lines[0].startswith(expected):
            wrong.append(f"--{name} {value!r}: exit {code}, stderr {lines}")
        if snapshot(run) != before or (Path(cfg.output_dir) != run and Path(cfg.output_dir).exists()):
            wrong.append(f"--{name} {value!r}: the refused resume wrote in {run}")
    assert not wrong, "\n".join(wrong)
    refused = [name for name, _, accepted in cases if not accepted]
    assert len(refused) > 10 and "learning_rate" in refused and "seed" in refused  # the sweep's usual axes
