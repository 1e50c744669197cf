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
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml
from conftest import CONFIGS, REPO, clean_env, free_port
from helpers import read_metrics, wandb_records

from common.config import parse_config
from search.sweep import build_command, load_sweep

with warnings.catch_warnings():  # the sweeps package still uses a pydantic v1 config key
    warnings.simplefilter("ignore")
    from wandb import wandb_agent

    import sweeps

SWEEP_FILES = sorted((REPO / "sweeps").glob("*.yaml"))
# What each template really logs once per evaluation, and which way is better.
TEMPLATE_METRIC = {
    "templates/image_classification.py": ("val/accuracy", "maximize"),
    "templates/language_model.py": ("val/loss", "minimize"),
    "templates/finetune_causal_lm.py": ("val/loss", "minimize"),
}
# Settings that make one launch take seconds; added after the sweep's argv in the every-rank test.
TINY = {
    "templates/image_classification.py": ["--epochs=1", "--stop_after_steps=1", "--tracker=none", "--num_workers=0"],
    "templates/language_model.py": ["--max_steps=1", "--eval_every_steps=0", "--eval_batches=2", "--sample_tokens=0",
                                    "--block_size=16", "--tracker=none", "--num_workers=0"],
    # {tiny_model} and {data}: the offline model of scripts/make_tiny_model.py and its task, filled in by the test
    "templates/finetune_causal_lm.py": ["--model={tiny_model}", "--data_path={data}", "--max_steps=1",
                                        "--eval_every_steps=0", "--sample_tokens=0", "--tracker=none"],
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
        "command": ["${env}", "accelerate", "launch", "--config_file", "accelerate_configs/cpu.yaml", "${program}",
                    "${args}"],
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
def test_agent_argv_reaches_every_rank_unchanged(path, monkeypatch, tmp_path, tiny_model):
    """The agent's argv, launched on 2 gloo ranks (cpu_ddp.yaml): each rank parses the same config."""
    config = read(path)
    np.random.seed(2)
    proposal = propose(config)
    prefix, options = split_agent_argv(agent_argv(config, proposal, monkeypatch, tmp_path), config)
    launch = prefix[:-1]  # /usr/bin/env accelerate launch --config_file <config>
    launch[launch.index("--config_file") + 1] = str(CONFIGS / "cpu_ddp.yaml")
    out = tmp_path / "run"
    sys.path.insert(0, str(REPO / "scripts"))
    from make_tiny_model import reverse_task

    data = tmp_path / "reverse.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in reverse_task(100)))
    tiny = [o.format(tiny_model=tiny_model, data=data) for o in TINY[config["program"]]] + [f"--output_dir={out}"]
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
    recorded = json.loads((out / "run.json").read_text())["config"]  # with the settings that are no option ("records
    assert {k: v for k, v in recorded.items() if " " not in k} == ranks[0]  # split by"), named with spaces


# ------------------------------------------------------------------- runs as `wandb agent` starts them
# The shipped sweep files, run the way `wandb agent` runs them: wandb's own Agent builds each run's argv
# and environment (WANDB_SWEEP_ID, WANDB_RUN_ID, ...), the process starts from a checkout of this
# repository, and nothing is added to the command. Only the sweep's training length is shortened.
AGENT_CASES = {
    "image_classification": dict(config="cpu.yaml", short={"epochs": 2}, long={"epochs": 5}, shape=("width", "depth")),
    "language_model": dict(config="cpu_ddp.yaml", short={"max_steps": 12, "eval_every_steps": 6},
                           long={"max_steps": 60, "eval_every_steps": 10}, shape=("n_layer", "n_embd", "n_head")),
}
SWEEP_ID = "swp0test"


def record_kinds(run_dir: Path) -> list[str]:
    return [record.WhichOneof("record_type") for record in wandb_records(run_dir)]


class SweepAgent:
    """wandb's own Agent, offline, in a checkout: `start` builds a run's command and environment with the
    agent's `_command_run` and starts it as its AgentProcess does (Popen, the agent's environment);
    `stop` is the agent's `_command_stop` (SIGTERM to the command it started)."""

    def __init__(self, checkout: Path, sweep_config: dict, monkeypatch):
        self.checkout, self.sweep_config, self.monkeypatch = checkout, sweep_config, monkeypatch

    def start(self, run_id: str, proposal: dict, output) -> subprocess.Popen:
        captured = {}

        class Recorder:
            def __init__(self, command=None, env=None, **kwargs):
                captured.update(command=command, env=env)

        self.monkeypatch.setattr(wandb_agent, "AgentProcess", Recorder)
        self.monkeypatch.chdir(self.checkout)
        self.monkeypatch.setenv("WANDB_DIR", str(self.checkout))
        self.monkeypatch.setenv("WANDB_SWEEP_ID", SWEEP_ID)  # as `wandb agent` sets it for its runs
        self.monkeypatch.setenv("WANDB_RUN_ID", "unset")  # _command_run sets it; monkeypatch restores it
        agent = wandb_agent.Agent(api=None, queue=None, sweep_id=SWEEP_ID)
        agent._sweep_command = list(self.sweep_config["command"])
        agent._command_run({"type": "run", "run_id": run_id, "program": self.sweep_config["program"], "args": proposal})
        # WANDB_SERVICE: the socket of a W&B service an earlier in-process test started, not the agent's
        agent_vars = {k: v for k, v in captured["env"].items()
                      if k.startswith("WANDB_") and k not in ("WANDB_MODE", "WANDB_SERVICE")}
        env = clean_env(**agent_vars, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        return subprocess.Popen(captured["command"], cwd=self.checkout, env=env, stdout=output,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def run(self, run_id: str, proposal: dict, signum: int | None = None, folder: Path | None = None
            ) -> tuple[int, str]:
        """Start a run and wait for it. With `signum`, signal it once its first checkpoint is in `folder`:
        SIGTERM to the command (the agent's stop) or SIGUSR1 to the training processes (a scheduler's
        preemption warning, passed on to them as scripts/slurm_train.sbatch does)."""
        log = self.checkout / f"{run_id}.{signum or 0}.log"
        with log.open("w") as handle:
            proc = self.start(run_id, proposal, handle)
            if signum is not None:
                while proc.poll() is None and not list((folder / "checkpoints").glob("step_*")):
                    time.sleep(0.05)
                if signum == signal.SIGTERM:
                    proc.terminate()  # wandb_agent.AgentProcess.terminate
                else:
                    for rank in psutil.Process(proc.pid).children():  # the launcher's children: the ranks
                        rank.send_signal(signum)
            proc.wait(timeout=300)
        return proc.returncode, log.read_text()


def sweep_checkout(root: Path) -> Path:
    """The parts of this repository a user runs `wandb agent` in: templates, common, configs, sweeps."""
    checkout = root / "checkout"
    for part in ("templates", "common", "accelerate_configs", "sweeps"):
        shutil.copytree(REPO / part, checkout / part, ignore=shutil.ignore_patterns("__pycache__"))
    return checkout


def with_values(sweep_config: dict, values: dict) -> dict:
    """The sweep with some parameters fixed (a shorter run), as a user would edit the file."""
    return dict(sweep_config, parameters={**sweep_config["parameters"], **{k: {"value": v} for k, v in values.items()}})


def proposals_with_shapes(sweep_config: dict, shape: tuple[str, ...], count: int) -> list[dict]:
    """`count` proposals of W&B's engine, the first two of different model shapes."""
    np.random.seed(3)
    found = [propose(sweep_config)]
    while len(found) < count:
        proposal = propose(sweep_config)
        if len(found) > 1 or any(proposal[k]["value"] != found[0][k]["value"] for k in shape):
            found.append(proposal)
    return found


@pytest.mark.parametrize("template", sorted(AGENT_CASES))
def test_wandb_agent_runs_each_run_in_its_own_folder_and_requeues_only_preempted_runs(template, monkeypatch, tmp_path):
    case = AGENT_CASES[template]
    checkout = sweep_checkout(tmp_path)
    sweep_config = read(checkout / "sweeps" / f"{template}.yaml")
    command = sweep_config["command"]
    command[command.index("--config_file") + 1] = f"accelerate_configs/{case['config']}"
    if case["config"] != "cpu.yaml":  # two ranks: the sweep file's advice for agents sharing a machine
        command[command.index("--config_file"):command.index("--config_file")] = ["--main_process_port",
                                                                                  str(free_port())]
    agent = SweepAgent(checkout, sweep_config, monkeypatch)
    runs_root = checkout / "runs" / template / SWEEP_ID

    # Three runs one after another, the first two of different model shapes: each trains from scratch
    # in its own folder, with exactly its proposed values, and reports its own result.
    short = with_values(sweep_config, case["short"])
    finals = {}
    for number, proposal in enumerate(proposals_with_shapes(short, case["shape"], 3)):
        run_id = f"run{number}"
        code, output = agent.run(run_id, proposal)
        assert code == 0, output[-3000:]
        assert "resumed from" not in output
        folder = runs_root / run_id
        config = json.loads((folder / "run.json").read_text())["config"]
        for name, spec in proposal.items():
            assert_arrived(config[name], spec["value"], name)
        assert config["output_dir"] == f"runs/{template}/{SWEEP_ID}/{run_id}"
        assert (folder / "model.safetensors").is_file()
        losses = [r["val/loss"] for r in read_metrics(folder) if "val/loss" in r]
        assert losses and losses not in finals.values()  # a result of its own, not the run before's
        finals[run_id] = losses
        assert "preempting" not in record_kinds(folder)
    assert sorted(p.name for p in runs_root.iterdir()) == ["run0", "run1", "run2"]
    assert not (checkout / "runs" / template / "checkpoints").exists()

    long = with_values(sweep_config, case["long"])
    np.random.seed(4)
    proposal = propose(long)

    # Preempted (the scheduler's SIGUSR1): checkpoint, marked preempting, non-zero exit: W&B requeues it.
    folder = runs_root / "preempted"
    code, output = agent.run("preempted", proposal, signal.SIGUSR1, folder)
    assert code != 0 and "by SIGUSR1 (preemption)" in output, output[-3000:]
    checkpoints = sorted((folder / "checkpoints").glob("step_*"))
    assert checkpoints, output[-3000:]
    kinds = record_kinds(folder)
    assert "preempting" in kinds
    assert [r.exit.exit_code for r in wandb_records(folder) if r.WhichOneof("record_type") == "exit"] == [75]
    # ... and the agent that gets it again (same run id, same values) resumes it from its own checkpoint.
    code, output = agent.run("preempted", proposal)
    assert code == 0, output[-3000:]
    assert f"resumed from runs/{template}/{SWEEP_ID}/preempted/checkpoints/{checkpoints[-1].name}" in output
    assert (folder / "model.safetensors").is_file()

    # Stopped by the agent (early termination): it ends for good, never marked preempting. (accelerate's
    # launcher passes SIGTERM to the whole process tree, W&B's service included, so the W&B run may end
    # without an exit record; when it has one, it says 0.)
    folder = runs_root / "stopped"
    code, output = agent.run("stopped", proposal, signal.SIGTERM, folder)
    assert "from the W&B sweep agent" in output and "not requeued" in output, output[-3000:]
    # its line last: no C++ abort after it ("terminate called without an active exception", seen once), no traceback
    assert "terminate called" not in output and "Traceback" not in output, output[-3000:]
    assert sorted((folder / "checkpoints").glob("step_*")), output[-3000:]
    assert "preempting" not in record_kinds(folder)
    assert [r.exit.exit_code for r in wandb_records(folder) if r.WhichOneof("record_type") == "exit"] in ([], [0])
    assert not (folder / "model.safetensors").exists()
