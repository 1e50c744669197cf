"""No code runs from a checkpoint, no W&B key lands in a file, no sweep value reaches a shell.

- Every pickle in a checkpoint is opened with torch's weights-only unpickler (FSDP's `.metadata`
  with an allowlist) before accelerate loads anything: a tampered file is refused in one line and
  the code it carries never runs.
- A real template run with WANDB_API_KEY set writes the key nowhere: not in its logs, run.json,
  metrics.jsonl, checkpoints or the offline W&B run.
- Search trials start from argument lists: a sampled value full of shell syntax arrives verbatim.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, clean_env

IMAGE = REPO / "templates" / "image_classification.py"
TINY = ["--epochs", "1", "--width", "8", "--depth", "1", "--batch_size", "512", "--tracker", "none"]


class Payload:
    """Unpickling this creates a file: what a malicious checkpoint would do (with worse commands)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def run(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env or clean_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("security") / "run"
    result = run(str(IMAGE), *TINY, "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


# ------------------------------------------------------------------------------------ pickles
# random_states: accelerate would load it weights-only too, but swallow the refusal and resume inexactly.
@pytest.mark.parametrize("victim", ["random_states_0.pkl", "optimizer.bin"])
def test_a_checkpoint_file_holding_a_malicious_pickle_is_refused_and_its_code_never_runs(finished_run, tmp_path,
                                                                                         victim):
    checkpoint = tmp_path / "downloaded"
    shutil.copytree(sorted((finished_run / "checkpoints").glob("step_*"))[-1], checkpoint)
    marker = tmp_path / f"pwned_{uuid.uuid4().hex}"
    original = torch.load(checkpoint / victim, weights_only=False)  # our own file: safe to load fully here
    torch.save({"evil": Payload(marker), "original": original}, checkpoint / victim)  # still a valid torch file
    result = run(str(IMAGE), *TINY, "--resume", str(checkpoint), "--output_dir", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[0].startswith(f"error: checkpoint {checkpoint}: refused {victim}: it holds more than plain data, "
                               "loading it could run code (Trying to load unsupported GLOBAL posix.system"), lines[0]
    assert not marker.exists()
    assert not (tmp_path / "out" / "run.json").exists()  # nothing written for a refused checkpoint


def sharded_checkpoint(folder: Path, extra) -> Path:
    """A torch.distributed.checkpoint folder as FSDP writes one: tensors, plus non-tensor entries pickled."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"weight": torch.ones(3, 2)}, "optimizer": {"param_groups": [{"lr": 0.1, "extra": extra}]}},
             checkpoint_id=str(folder))
    return folder


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process writes the test's folders
def test_sharded_checkpoint_pickles_are_checked_too(tmp_path):
    """torch.distributed.checkpoint reads `.metadata` with pickle.load and non-tensors with weights_only=False."""
    from common.pickle_allowlist import check_pickles
    from common.errors import UsageError

    marker = tmp_path / f"pwned_{uuid.uuid4().hex}"
    good = tmp_path / "good"
    sharded_checkpoint(good / "pytorch_model_fsdp_0", extra=[1, 2.5, "text"])
    check_pickles(good)  # what FSDP writes passes

    bad_entry = tmp_path / "bad_entry"
    sharded_checkpoint(bad_entry / "optimizer_0", extra=Payload(marker))
    with pytest.raises(UsageError, match=r"refused optimizer_0: it holds more than plain data.*posix.system"):
        check_pickles(bad_entry)

    bad_metadata = tmp_path / "bad_metadata"
    shutil.copytree(good, bad_metadata)
    metadata = bad_metadata / "pytorch_model_fsdp_0" / ".metadata"
    metadata.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UsageError, match=r"refused pytorch_model_fsdp_0: it holds more than plain data"
                                         r".*posix.system is not allowed"):
        check_pickles(bad_metadata)
    assert not marker.exists()


def test_every_pickle_of_a_real_checkpoint_passes_and_a_tampered_one_fails(finished_run, tmp_path):
    from common.pickle_allowlist import check_pickles
    from common.errors import UsageError

    checkpoint = sorted((finished_run / "checkpoints").glob("step_*"))[-1]
    check_pickles(checkpoint)
    for victim in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        copy = tmp_path / victim
        shutil.copytree(checkpoint, copy)
        torch.save([Payload(tmp_path / "pwned")], copy / victim)
        with pytest.raises(UsageError, match=f"refused {victim}: it holds more than plain data"):
            check_pickles(copy)
    assert not (tmp_path / "pwned").exists()


def test_the_code_loads_pickles_only_weights_only():
    """No pickle.load and no torch.load without weights_only=True in the templates, common/ and search/."""
    offenders = []
    for path in [*sorted((REPO / "common").glob("*.py")), *sorted((REPO / "templates").glob("*.py")),
                 *sorted((REPO / "search").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            weights_only = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                               for k in node.keywords)
            if name in ("pickle.load", "pickle.loads", "torch.load") and not (name == "torch.load" and weights_only):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
            if name in ("os.system", "os.popen") or any(k.arg == "shell" for k in node.keywords):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


# ------------------------------------------------------------------------------------ W&B key
def test_wandb_api_key_is_in_no_file_and_no_log_of_a_real_run(tmp_path):
    secret = "e2e" + uuid.uuid4().hex + "0123456789"  # 45 characters, like a key
    out = tmp_path / "run"
    env = clean_env(WANDB_API_KEY=secret)  # WANDB_MODE=offline from clean_env: nothing leaves the machine
    result = run(str(IMAGE), *TINY, "--tracker", "wandb", "--output_dir", str(out), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert secret not in result.stdout + result.stderr
    files = [p for p in out.rglob("*") if p.is_file()]
    kinds = {p.name for p in files} | {p.suffix for p in files}
    expected = {"run.json", "metrics.jsonl", "progress.json", "model.safetensors", ".wandb", "debug.log"}
    assert expected <= kinds, sorted(kinds)
    assert [str(p) for p in files if secret.encode() in p.read_bytes()] == []


# --------------------------------------------------------------------------------- no shell
PROBE = '''
import json, os, sys
opts = dict(token[2:].split("=", 1) for token in sys.argv[1:])
os.makedirs(opts["output_dir"], exist_ok=True)
with open(os.path.join(opts["output_dir"], "argv.json"), "w") as handle:
    json.dump(sys.argv[1:], handle)
with open(os.path.join(opts["output_dir"], "metrics.jsonl"), "a") as handle:
    handle.write(json.dumps({"step": 1, "val/accuracy": 0.5}) + "\\n")
'''


def test_sweep_values_full_of_shell_syntax_reach_the_trial_verbatim_and_run_nothing(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    marker = Path("/tmp") / f"pwned_{uuid.uuid4().hex}"
    values = [f"x; touch {marker}_1", f"$(touch {marker}_2)", f"`touch {marker}_3`", f"x && touch {marker}_4 | cat",
              f"'; touch {marker}_5; '", f"x\ntouch {marker}_6"]
    sweep = {"name": "shell", "program": str(probe), "method": "grid",
             "metric": {"name": "val/accuracy", "goal": "maximize"}, "parameters": {"note": {"values": values}},
             "command": ["${env}", "${interpreter}", "${program}", "${args}"]}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    result = run("-m", "search", "--sweep", str(tmp_path / "sweep.yaml"), "--output_dir", str(tmp_path / "out"),
                 "--n_trials", str(len(values)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    received = [json.loads(p.read_text()) for p in sorted((tmp_path / "out" / "shell").glob("trial_*/argv.json"))]
    assert sorted(argv[0] for argv in received) == sorted(f"--note={value}" for value in values)
    assert sorted(Path("/tmp").glob(f"{marker.name}*")) == []
