"""The sweep files in sweeps/: W&B accepts them, and what `wandb agent` runs reaches the template intact.

The argv comes from wandb's own agent code (`wandb.wandb_agent.Agent._command_run`, with the process
start replaced by a recorder), fed with proposals of W&B's own sweep engine (`sweeps.next_run`), all offline.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import CONFIGS, REPO, clean_env, free_port

from common.config import parse_config
from common.sweep import build_command, load_sweep

with warnings.catch_warnings():  # the sweeps package still uses a pydantic v1 config key
    warnings.simplefilter("ignore")
    import sweeps
    from wandb import wandb_agent

SWEEP_FILES = sorted((REPO / "sweeps").glob("*.yaml"))
# What each template really logs once per evaluation, and which way is better.
TEMPLATE_METRIC = {
    "templates/image_classification.py": ("val/accuracy", "maximize"),
    "templates/language_model.py": ("val/loss", "minimize"),
}
# Settings that make one launch take seconds; added after the sweep's argv in the every-rank test.
TINY = {
    "templates/image_classification.py": ["--epochs=1", "--stop_after_steps=1", "--tracker=none", "--num_workers=0"],
    "templates/language_model.py": ["--max_steps=1", "--eval_every_steps=0", "--eval_batches=2", "--sample_tokens=0",
                                    "--block_size=16", "--tracker=none", "--num_workers=0"],
}


def ids(path: Path) -> str:
    return path.stem


def read(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@functools.cache
def template_module(program: str):
    spec = importlib.util.spec_from_file_location(f"template_{Path(program).stem}", REPO / program)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def propose(sweep_config: dict) -> dict:
    """One run config from W&B's sweep engine, as the agent receives it (the server sends JSON)."""
    run = sweeps.next_run(sweep_config, runs=[], validate=True)
    return json.loads(json.dumps(run.config, default=lambda o: o.item()))


def agent_argv(sweep_config: dict, run_args: dict, monkeypatch, tmp_path: Path) -> list[str]:
    """The argument list `wandb agent` would start for this run, from wandb's own code."""
    captured = {}

    class Recorder:
        def __init__(self, command=None, **kwargs):
            captured["command"] = command

    monkeypatch.setattr(wandb_agent, "AgentProcess", Recorder)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SWEEP_ID", "offline")
    monkeypatch.setenv("WANDB_RUN_ID", "unset")  # _command_run sets it; monkeypatch restores it
    agent = wandb_agent.Agent(api=None, queue=None, sweep_id="offline")
    agent._sweep_command = list(sweep_config.get("command") or [])  # as Agent.run() takes it from the sweep
    agent._command_run({"type": "run", "run_id": "run1", "program": sweep_config.get("program"), "args": run_args})
    return captured["command"]


def split_agent_argv(argv: list[str], sweep_config: dict) -> tuple[list[str], list[str]]:
    """(everything up to and including the program, the options)."""
    at = argv.index(sweep_config["program"])
    return argv[: at + 1], argv[at + 1:]


def assert_arrived(parsed, proposed, name: str) -> None:
    if isinstance(proposed, bool):
        assert parsed is proposed, name
    elif isinstance(proposed, float):
        assert parsed == proposed and type(parsed) in (float, int), f"{name}: {parsed!r} != {proposed!r}"
        if type(parsed) is float:
            assert parsed.hex() == proposed.hex(), name  # bit for bit
    else:
        assert parsed == proposed and type(parsed) is type(proposed), f"{name}: {parsed!r} != {proposed!r}"


# ------------------------------------------------------------------------------------ the files
def test_every_template_has_a_sweep_file():
    have = {read(path)["program"] for path in SWEEP_FILES}
    templates = {f"templates/{p.name}" for p in (REPO / "templates").glob("*.py")}
    assert templates <= have, f"templates without a sweep file: {sorted(templates - have)}"


@pytest.mark.parametrize("path", SWEEP_FILES, ids=ids)
def test_sweep_file_passes_wandb_schema_and_fits_its_template(path):
    config = read(path)
    assert sweeps.schema_violations_from_proposed_config(config) == []
    sweeps.SweepConfig(config)  # W&B's full check, defaults filled in
    load_sweep(path)  # and the local runner maps every parameter

    program = config["program"]
    assert (REPO / program).is_file()
    assert config["method"] in ("bayes", "random")
    assert (config["metric"]["name"], config["metric"]["goal"]) == TEMPLATE_METRIC[program]
    assert f'"{config["metric"]["name"]}"' in (REPO / program).read_text()  # the template logs it by that name
    assert config["early_terminate"]["type"] == "hyperband"
    assert config["command"][:4] == ["${env}", "accelerate", "launch", "--config_file"]
    assert (REPO / config["command"][4]).is_file() and config["command"][5:] == ["${program}", "${args}"]

    fields = {f.name: f for f in dataclasses.fields(template_module(program).Config)}
    assert set(config["parameters"]) <= set(fields), set(config["parameters"]) - set(fields)
    assert "learning_rate" in config["parameters"] and "batch_size" in config["parameters"]
    for name, spec in config["parameters"].items():
        for key in ("min", "max"):
            assert not isinstance(spec.get(key), str), f"{name}.{key} is a string: write 1.0e-4, not 1e-4"


@pytest.mark.parametrize("path", SWEEP_FILES, ids=ids)
def test_agent_argv_parses_to_the_proposed_values(path, monkeypatch, tmp_path):
    config = read(path)
    module = template_module(config["program"])
    sweep = load_sweep(path)
    np.random.seed(0)  # the sweeps engine draws from numpy's global generator
    for _ in range(25):
        proposal = propose(config)
        argv = agent_argv(config, proposal, monkeypatch, tmp_path)
        prefix, options = split_agent_argv(argv, config)
        assert prefix == ["/usr/bin/env", *config["command"][1:5], config["program"]]
        parsed = module.parse_config(module.Config, options)
        for name, spec in proposal.items():
            assert_arrived(getattr(parsed, name), spec["value"], name)
        # The local runner words the same values exactly as the agent does.
        values = {name: spec["value"] for name, spec in proposal.items()}
        assert build_command(sweep, values)[-len(options):] == options


@dataclass
class AllTypes:
    learning_rate: float = 1e-3
    batch_size: int = 32
    augment: bool = True
    hidden: list[int] = field(default_factory=lambda: [64])
    tags: list[str] = field(default_factory=list)
    schedule: str = "cosine"
    clip: float | None = 1.0


def test_agent_argv_keeps_floats_ints_booleans_lists(monkeypatch, tmp_path):
    config = {
        "program": "train.py",
        "method": "random",
        "metric": {"name": "val/loss", "goal": "minimize"},
        "parameters": {
            "learning_rate": {"distribution": "log_uniform_values", "min": 1e-7, "max": 1e3},
            "batch_size": {"distribution": "q_log_uniform_values", "min": 8, "max": 512, "q": 8},
            "augment": {"values": [True, False]},
            "hidden": {"values": [[64, 128], [256], []]},
            "tags": {"values": [["a", "b c"], ["it's"]]},
            "schedule": {"values": ["cosine", "linear"]},
            "clip": {"values": [None, 0.5]},
        },
        "command": ["${env}", "accelerate", "launch", "--config_file", "accelerate_configs/cpu.yaml", "${program}", "${args}"],
    }
    np.random.seed(1)
    seen = {name: set() for name in config["parameters"]}
    for _ in range(40):
        proposal = propose(config)
        _, options = split_agent_argv(agent_argv(config, proposal, monkeypatch, tmp_path), config)
        parsed = parse_config(AllTypes, options)
        for name, spec in proposal.items():
            value = spec["value"]
            if name == "batch_size":
                value = int(value)  # q_log_uniform_values with an int q: W&B may send 64.0
            assert_arrived(getattr(parsed, name), value, name)
            seen[name].add(json.dumps(value))
    assert all(len(values) > 1 for values in seen.values()), seen


@pytest.mark.parametrize("path", SWEEP_FILES, ids=ids)
def test_agent_argv_reaches_every_rank_unchanged(path, monkeypatch, tmp_path):
    """The agent's argv, launched on 2 gloo ranks (cpu_ddp.yaml): each rank parses the same config."""
    config = read(path)
    np.random.seed(2)
    proposal = propose(config)
    prefix, options = split_agent_argv(agent_argv(config, proposal, monkeypatch, tmp_path), config)
    launch = prefix[:-1]  # /usr/bin/env accelerate launch --config_file <config>
    launch[launch.index("--config_file") + 1] = str(CONFIGS / "cpu_ddp.yaml")
    out = tmp_path / "run"
    tiny = TINY[config["program"]] + [f"--output_dir={out}"]
    argv = [*launch, "--main_process_port", str(free_port()), str(REPO / "tests" / "sweep_probe.py"), *options, *tiny]
    env = clean_env(PROBE_TEMPLATE=str(REPO / config["program"]), PROBE_DIR=str(tmp_path),
                    PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    ranks = [json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1]
    overridden = {option.split("=")[0][2:] for option in tiny}
    for name, spec in proposal.items():
        if name not in overridden:
            assert_arrived(ranks[0][name], spec["value"], name)
    assert json.loads((out / "run.json").read_text())["config"] == ranks[0]
