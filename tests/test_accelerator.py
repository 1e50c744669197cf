"""common.accelerator: mixed precision by hardware, and the Accelerator every template builds."""

from __future__ import annotations

import itertools
import os
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

import common.accelerator as accel_module
from conftest import REPO, clean_env, launch
from common.accelerator import Throughput, build_accelerator, describe, device_peak_tflops, resolve_mixed_precision
from common.config import MIXED_PRECISION_CHOICES

# --- resolve_mixed_precision: every request on every kind of hardware --------------------------

CPU, GPU_BF16, GPU_NO_BF16 = (False, False), (True, True), (True, False)
EXPECTED = {  # (requested, hardware) -> (result, warns)
    ("auto", CPU): ("no", False), ("no", CPU): ("no", False),
    ("bf16", CPU): ("no", True), ("fp16", CPU): ("no", True),
    ("auto", GPU_BF16): ("bf16", False), ("no", GPU_BF16): ("no", False),
    ("bf16", GPU_BF16): ("bf16", False), ("fp16", GPU_BF16): ("fp16", False),
    ("auto", GPU_NO_BF16): ("fp16", False), ("no", GPU_NO_BF16): ("no", False),
    ("bf16", GPU_NO_BF16): ("fp16", True), ("fp16", GPU_NO_BF16): ("fp16", False),
}


def test_expected_table_covers_every_choice():
    assert {requested for requested, _ in EXPECTED} == set(MIXED_PRECISION_CHOICES)


@pytest.mark.parametrize("requested, hardware", list(EXPECTED), ids=[f"{r}-{h}" for r, h in EXPECTED])
def test_resolve_mixed_precision(requested, hardware):
    has_cuda, has_bf16 = hardware
    result, warns = EXPECTED[requested, hardware]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_mixed_precision(requested, has_cuda=has_cuda, has_bf16=has_bf16) == result
    # A request that is not honoured says so; one that is honoured stays quiet.
    assert len(caught) == (1 if warns else 0), [str(w.message) for w in caught]


# --- build_accelerator: what it asks accelerate for (hardware faked, Accelerator recorded) ------

class RecordingAccelerator:
    """Stands in for accelerate.Accelerator and keeps the arguments build_accelerator passed."""

    last: dict = {}

    def __init__(self, **kwargs):
        RecordingAccelerator.last = kwargs


@pytest.mark.parametrize("has_bf16, expected", [(True, "bf16"), (False, "fp16")])
def test_build_accelerator_on_a_gpu_asks_for_what_the_gpu_has(monkeypatch, has_bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: has_bf16)
    monkeypatch.setattr(accel_module, "Accelerator", RecordingAccelerator)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    build_accelerator(seed=5, mixed_precision="auto", gradient_accumulation_steps=3, timeout_s=42)
    args = RecordingAccelerator.last
    assert args["mixed_precision"] == expected and args["cpu"] is False
    assert args["gradient_accumulation_plugin"].num_steps == 3
    loader_config = args["dataloader_config"]
    assert loader_config.use_seedable_sampler is True and loader_config.data_seed == 5
    assert loader_config.non_blocking is True  # asynchronous host-to-GPU copies (pinned memory)
    (handler,) = args["kwargs_handlers"]
    assert handler.timeout == timedelta(seconds=42)
    # One scheduler tick per optimizer step whatever the world size (the templates size schedules so);
    # the 2-rank test in test_checkpoint.py checks the ticks themselves.
    assert args["step_scheduler_with_optimizer"] is False


def test_build_accelerator_force_cpu_ignores_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(accel_module, "Accelerator", RecordingAccelerator)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "")  # restored after the test; build_accelerator overwrites it
    build_accelerator(seed=0, force_cpu=True)
    assert RecordingAccelerator.last["cpu"] is True
    assert RecordingAccelerator.last["mixed_precision"] == "no"
    assert RecordingAccelerator.last["dataloader_config"].non_blocking is False


# --- build_accelerator for real, on this CPU machine --------------------------------------------

@pytest.mark.parametrize("requested", ["auto", "bf16"])
def test_build_accelerator_on_cpu(fresh_accelerate, requested):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 requested on CPU warns; tested above
        accelerator = build_accelerator(seed=1, mixed_precision=requested, gradient_accumulation_steps=2, timeout_s=123)
    assert accelerator.mixed_precision == "no"
    assert accelerator.device.type == "cpu"
    assert accelerator.num_processes == 1
    assert accelerator.gradient_accumulation_steps == 2
    assert accelerator.scaler is None
    # The timeout reaches the process-group kwargs, so a dead rank ends the job instead of hanging it.
    assert accelerator.init_handler.timeout == timedelta(seconds=123)
    assert accelerator.init_handler.to_kwargs()["timeout"] == timedelta(seconds=123)
    assert os.environ["ACCELERATE_USE_CPU"] == "true"


def test_build_accelerator_fsdp_config_on_one_cpu_process_is_plain_training(fresh_accelerate, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    accelerator = build_accelerator(seed=0)
    assert accelerator.distributed_type.value == "NO"
    assert getattr(accelerator.state, "fsdp_plugin", None) is None


def test_describe_is_one_line(fresh_accelerate):
    accelerator = build_accelerator(seed=0, gradient_accumulation_steps=4)
    line = describe(accelerator)
    assert "\n" not in line
    assert line == "1 process on cpu, mixed precision no, gradient accumulation 4"


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A10", 125.0), ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.0),
    ("NVIDIA GeForce RTX 4090", 165.2), ("Tesla V100-SXM2-16GB", 125.0),
    ("NVIDIA A10G", None), ("Some Future GPU", None),  # no published or known peak: no MFU rather than a guess
])
def test_peak_flops_by_device_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_tflops(torch.device("cuda"), 0.0) == peak
    assert device_peak_tflops(torch.device("cuda"), 400.0) == 400.0  # --peak_tflops wins
    assert device_peak_tflops(torch.device("cpu"), 0.0) is None


def test_throughput_counts_items_of_all_processes_and_gives_mfu_only_with_a_peak(monkeypatch, capsys):
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=2, gradient_accumulation_steps=2,
                                  is_main_process=True)
    clock = itertools.chain([100.0, 100.5, 100.75, 101.0, 101.5, 101.75, 102.0], itertools.count(103.0))
    monkeypatch.setattr(accel_module.time, "perf_counter", lambda: next(clock))
    meter = Throughput(accelerator, "tokens", 1000, 3, flops_per_item=6e6, peak_tflops=1.0)  # starts at 100 s
    for _ in meter.timed(range(2)):  # waits 100.5-100.75 and 101-101.5 s for its two micro-batches
        pass
    figures = meter.read()  # at 102 s: 2 micro-batches of 1000 tokens on each of 2 processes in 2 s
    assert figures["tokens_per_s"] == 2000.0
    assert figures["time/data_wait"] == pytest.approx(0.75 / 2)
    assert figures["time/step_ms"] == pytest.approx(2000.0)  # one optimizer step of 2 micro-batches
    assert figures["tokens_per_step"] == 4000.0  # 2 micro-batches of 1000 tokens on each of 2 processes
    assert figures["mfu"] == pytest.approx(2000 * 6e6 / (2 * 1e12))
    assert figures["peak_memory_gb"] > 0
    assert meter.batches == 0 and meter.waited == 0  # the next interval started at the reading
    assert "waited for data" not in capsys.readouterr().out  # one slow interval: an epoch's start, say
    next(meter.timed(range(1)))  # 103-104 s waited, read at 106 s: a second slow interval in a row
    meter.read()
    assert "waited for data 33% of the time: raise --num_workers (now 3)" in capsys.readouterr().out
    for _ in range(2):
        next(meter.timed(range(1)))
        meter.read()
    assert "waited for data" not in capsys.readouterr().out  # the warning comes once
    tokens = Throughput(accelerator, "tokens", lambda batch: torch.tensor(batch).sum(), 0)
    for _ in tokens.timed([[1, 2], [3, 4]]):  # counted on the device: 10 tokens per process
        pass
    assert tokens.items.item() == 10 and tokens.read()["tokens_per_s"] > 0
    assert set(Throughput(accelerator, "images", 10, 0).read()) == {"images_per_s", "images_per_step", "time/data_wait",
                                                                    "time/step_ms", "peak_memory_gb"}  # no MFU


# --- what a user reads last under `accelerate launch -q` (README, "Errors and exit codes") -------------------
# (accelerate config, fault injected by tests/fault_inject.py, the line that must end what the template prints)
LAST_LINES = {
    "stop-1-process": ("cpu.yaml", {"FAULT": "signal", "FAULT_SIGNAL": "USR1", "FAULT_STEP": "3"},
                       "stopped at step 3 by SIGUSR1 (preemption); checkpoint saved, continue with --resume auto"),
    "nan-1-process": ("cpu.yaml", {"FAULT": "nan_loss", "FAULT_STEP": "3"},
                      "error: non-finite gradients at step 3 (loss nan); no checkpoint was saved yet"),
    "nan-2-ranks": ("cpu_ddp.yaml", {"FAULT": "nan_loss", "FAULT_STEP": "3"},
                    "error: non-finite gradients at step 3 (loss nan); no checkpoint was saved yet"),
}
TORCHRUN_LOG = re.compile(r"^[DIWE]\d{4} \d\d:\d\d:\d\d")  # torch.distributed.elastic's log lines


def test_the_stop_or_error_line_is_the_last_a_user_reads_under_accelerate_launch_q(tmp_path):
    """W&B on, offline and not silenced as for a user: the lines it prints when its run ends come before ours.
    With several ranks torchrun's failure summary follows (accelerate prints it); the template's line ends the rest."""
    env = {k: v for k, v in clean_env().items() if k != "WANDB_SILENT"}

    def run(name):
        config, fault, _ = LAST_LINES[name]
        return launch(config, REPO / "tests" / "fault_inject.py", str(REPO / "templates" / "image_classification.py"),
                      "--epochs", "1", "--width", "8", "--depth", "1", "--output_dir", str(tmp_path / name),
                      launcher_args=("-q",), env=env | fault)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(LAST_LINES, pool.map(run, LAST_LINES)))
    for name, result in results.items():
        shown = f"{name}: exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        assert result.returncode == 1 and "Traceback" not in result.stderr, shown
        ours = [line for line in result.stderr.split("=" * 60)[0].splitlines() if line and not TORCHRUN_LOG.match(line)]
        assert ours[-1] == LAST_LINES[name][2], shown
        assert "wandb:" in result.stderr, shown  # W&B did print: before
