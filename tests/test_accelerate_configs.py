"""accelerate_configs/*.yaml: what accelerate itself reads from them, and multi_node.yaml's shape run for real."""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import DistributedType

from conftest import CONFIGS, REPO, free_port, launch, load_template
from helpers import read_metrics

TEMPLATE = REPO / "templates" / "image_classification.py"
CONFIG_FILES = sorted(CONFIGS.glob("*.yaml"))


def load(name: str) -> ClusterConfig:
    return load_config_from_file(str(CONFIGS / name))


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_every_config_loads_with_accelerates_own_loader(path):
    config = load_config_from_file(str(path))
    assert isinstance(config, ClusterConfig)
    assert config.compute_environment.value == "LOCAL_MACHINE"
    assert config.num_processes >= config.num_machines >= 1


def test_the_documented_configs_are_all_there():
    assert {p.name for p in CONFIG_FILES} >= {"cpu.yaml", "cpu_ddp.yaml", "single_gpu.yaml", "ddp.yaml", "fsdp.yaml",
                                              "multi_node.yaml"}


def test_cpu_is_one_cpu_process():
    config = load("cpu.yaml")
    assert config.distributed_type == DistributedType.NO
    assert (config.num_processes, config.num_machines, config.use_cpu) == (1, 1, True)


def test_cpu_ddp_is_two_processes_of_one_data_parallel_job():
    config = load("cpu_ddp.yaml")
    # MULTI_GPU is what makes `accelerate launch` start 2 ranks with a rendezvous (torchrun); it is
    # not what puts them on the CPU. The templates do that: build_accelerator passes cpu=True when
    # there is no GPU, so the two ranks join one gloo process group. use_cpu is false because in a
    # MULTI_GPU config the launcher ignores it (accelerate 1.x reads it only for single-process runs
    # and OMP thread counts); `true` would claim something this file does not do.
    assert config.distributed_type == DistributedType.MULTI_GPU
    assert (config.num_processes, config.num_machines, config.use_cpu) == (2, 1, False)
    assert config.mixed_precision == "no"


@pytest.mark.parametrize("name, distributed_type", [("single_gpu.yaml", DistributedType.NO),
                                                     ("ddp.yaml", DistributedType.MULTI_GPU)])
def test_gpu_configs_use_bf16(name, distributed_type):
    config = load(name)
    assert config.distributed_type == distributed_type
    assert config.mixed_precision == "bf16"
    assert config.use_cpu is False


def test_fsdp_is_fsdp2_sharded_and_wraps_the_templates_block():
    config = load("fsdp.yaml")
    assert config.distributed_type == DistributedType.FSDP
    fsdp = config.fsdp_config
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "Block"

    module = load_template("image_classification")
    assert isinstance(module.Block, type) and module.Block.__name__ == "Block"
    # ... and the model the template builds is made of Blocks, so the wrap policy has units to wrap.
    cfg = module.Config(width=8, depth=2)
    model = module.build_model(cfg, module.load_datasets(cfg))
    assert sum(type(m).__name__ == "Block" for m in model.modules()) >= 2


def test_multi_node_has_two_machines_and_every_field_commented():
    config = load("multi_node.yaml")
    assert config.num_machines == 2
    assert config.distributed_type == DistributedType.MULTI_GPU
    lines = (CONFIGS / "multi_node.yaml").read_text().splitlines()
    uncommented = []
    for number, line in enumerate(lines):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        assert re.match(r"^\s*[\w-]+:", line), f"line {number + 1} is not a key: {line!r}"
        above = lines[number - 1].lstrip() if number else ""
        if "#" not in line and not above.startswith("#"):
            uncommented.append(line)
    assert uncommented == []


def test_multi_node_shape_runs_as_one_job_on_two_local_machines(tmp_path):
    """multi_node.yaml with both "machines" on 127.0.0.1, one process each, one shared output folder."""
    out, port = tmp_path / "run", free_port()
    args = ("--epochs", "2", "--width", "8", "--depth", "1", "--tracker", "none", "--output_dir", str(out))

    def machine(rank: int) -> subprocess.CompletedProcess:
        return launch("multi_node.yaml", TEMPLATE, *args, num_processes=2, timeout=240, launcher_args=(
            "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
            "--main_process_port", str(port)))

    with ThreadPoolExecutor(max_workers=2) as pool:
        first, second = pool.map(machine, (0, 1))
    for result in (first, second):
        assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"

    # One job: each machine's first process prints (accelerator.print is once per machine), and both
    # report a job of two processes which split the data: 1438 digits / 64 per batch = 22 batches,
    # 11 per rank per epoch (one process alone would take 22 per epoch, 44 in all).
    for result in (first, second):
        assert "2 processes on cpu (MULTI_CPU)" in result.stdout, result.stdout
        assert "1438 training / 359 validation images" in result.stdout
        assert re.search(r"\b22 optimizer steps\b", result.stdout), result.stdout

    # One set of outputs: one run.json, each metric logged once, checkpoints holding both ranks' state.
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "metrics.jsonl", "model.safetensors",
                                                   "run.json", "status.json"]
    records = read_metrics(out)
    assert [(r["step"], r["epoch"]) for r in records if "val/accuracy" in r] == [(11, 1), (22, 2)]
    assert [r["val/samples"] for r in records if "val/accuracy" in r] == [359, 359]
    kinds = [(r["step"], "val/accuracy" in r) for r in records]
    assert len(kinds) == len(set(kinds)), records  # no line written twice
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["best_step_00000022", "step_00000011", "step_00000022"]
    for name in checkpoints:
        files = sorted(p.name for p in (out / "checkpoints" / name).iterdir())
        assert files == ["model.safetensors", "optimizer.bin", "progress.json", "random_states_0.pkl",
                         "random_states_1.pkl", "scheduler.bin"], (name, files)
        assert json.loads((out / "checkpoints" / name / "progress.json").read_text())["world_size"] == 2


def test_the_readmes_commands_in_a_copied_project_print_no_launcher_warning(tmp_path):
    """The README's 'Use a template' block run as written (its paths pointed here), but with a bad option: the
    template's `error:` line is all there is on stderr, not after accelerate's 3-line warning about CPU threads
    (it warns on a CPU config with more than one physical core unless the number is named)."""
    import os
    import shutil
    import sys

    import psutil

    from conftest import clean_env

    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Use a template in your project"):]
    block = section[section.index("```bash\n") + 8:section.index("```\n", section.index("```bash\n"))]
    commands = [line.replace("~/myproject", str(tmp_path / "myproject")).replace("/path/to/this/repo", str(REPO))
                for line in block.splitlines() if not line.startswith("cd ")]
    commands = [("cp " + line[3:].replace(" templates/", f" {REPO}/templates/").replace(" common ", f" {REPO}/common ")
                 .replace(" accelerate_configs/", f" {REPO}/accelerate_configs/")) if line.startswith("cp ") else line
                for line in commands]
    (tmp_path / "myproject").mkdir()
    launch_line = next(line for line in commands if line.startswith("accelerate launch"))
    script = "\n".join(["set -e", *[line for line in commands if line.startswith(("cp ", "export "))],
                        f"cd {tmp_path / 'myproject'}", launch_line + " --epochs=abc"])
    env = clean_env()
    env.pop("OMP_NUM_THREADS")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.stderr.splitlines() == ["error: --epochs: expected an integer, got 'abc'"], result.stderr
    assert result.returncode == 1 and shutil.which("accelerate", path=env["PATH"])
    if (psutil.cpu_count(logical=False) or 1) > 1:  # where accelerate warns at all: without the export, it does
        bare = subprocess.run(["bash", "-c", f"cd {tmp_path / 'myproject'} && {launch_line} --epochs=abc"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert "num_cpu_threads_per_process" in bare.stderr, bare.stderr
