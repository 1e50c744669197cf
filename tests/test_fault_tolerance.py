"""Fault tolerance end to end, through real processes: SIGKILL at drawn steps (also in the middle of a
checkpoint save, also of one rank of two), preemption signals sent to one rank only, a rank that
hangs, a full disk, an fp16 overflow and a NaN loss.

Every interrupted run is restarted with `--resume auto` until it finishes and must end with
parameters bit-identical (torch.equal) to an uninterrupted run, with dropout, shuffling, loader
workers and gradient accumulation on, and log the same metrics. Faults come from
tests/fault_inject.py, which runs the template's own main() and acts at an optimizer step.

Kill points are drawn with random.Random(seed) from a range of steps per event; FAULT_SEED_OFFSET=N
draws others (the README's figures are for offset 0). All runs of this module are started up front
by one fixture, two at a time, so the waits of one overlap the work of another.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import CONFIGS, REPO, clean_env, free_port, run_to_end, wait_for_no_processes
from helpers import read_metrics, snapshot, write_tiny_corpus
from common.errors import read_status

IMAGE = REPO / "templates" / "image_classification.py"
LM = REPO / "templates" / "language_model.py"
FT = REPO / "templates" / "finetune_causal_lm.py"
INJECT = REPO / "tests" / "fault_inject.py"
SEED_OFFSET = int(os.environ.get("FAULT_SEED_OFFSET", "0"))

# Dropout, shuffling, 2 loader workers, accumulation 2, a checkpoint every 2 steps, 2 epochs.
# 1438 digits / 96 = 14 micro-batches: 7 optimizer steps per epoch on one process (the last of a
# single micro-batch), 7 micro-batches = 4 steps per epoch on each of 2 ranks.
IMAGE_ARGS = ("--epochs", "2", "--width", "8", "--depth", "1", "--batch_size", "96",
              "--gradient_accumulation_steps", "2", "--dropout", "0.3", "--num_workers", "2",
              "--checkpoint_every_steps", "2", "--log_every_steps", "1", "--tracker", "none")
# 380 lines of text in windows of 32 tokens: 19 micro-batches per epoch (batch 16 on one process, 8 on
# each of 2 ranks), so 10 optimizer steps per epoch with accumulation 2; 14 steps cross an epoch.
LM_ARGS = ("--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--learning_rate", "1e-2",
           "--warmup_steps", "2", "--log_every_steps", "1", "--eval_every_steps", "5", "--eval_batches", "4",
           "--sample_tokens", "8", "--max_steps", "14", "--dropout", "0.1", "--num_workers", "1",
           "--gradient_accumulation_steps", "2", "--checkpoint_every_steps", "3", "--tracker", "none")
# The tiny Llama of scripts/make_tiny_model.py on 120 reverse-a-word examples (~108 for training): batch 8 with
# accumulation 2 is 13 micro-batches, 7 optimizer steps per epoch on one process and 3 on each of 2 ranks.
FT_ARGS = ("--max_steps", "12", "--eval_every_steps", "6", "--batch_size", "8", "--gradient_accumulation_steps", "2",
           "--checkpoint_every_steps", "3", "--log_every_steps", "1", "--num_workers", "1", "--learning_rate", "3e-3",
           "--warmup_steps", "2", "--sample_tokens", "4", "--tracker", "none")
FT_LORA = ("--lora_r", "4", "--lora_dropout", "0.1", "--learning_rate", "1e-2")
LLAMA_UNITS = ("--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer")  # what fsdp.yaml's `Block` is for Llama
DETERMINISTIC = ("train/loss", "lr", "epoch", "train/skipped_steps", "val/loss", "val/accuracy", "val/samples",
                 "val/bpb")


@dataclass(frozen=True)
class Event:
    fault: str  # what tests/fault_inject.py does: kill, kill_save, signal, signal_launcher, enospc, nan_loss
    seed: int
    low: int  # the step is drawn from [low, high]
    high: int
    rank: int = 0  # the rank that acts
    signal: str = "TERM"

    @property
    def step(self) -> int:
        return random.Random(self.seed + SEED_OFFSET).randint(self.low, self.high)


@dataclass(frozen=True)
class Cell:
    template: Path
    # None: `python template.py`; else `accelerate launch` with this config (2 processes unless cpu.yaml)
    config: str | None
    events: tuple[Event, ...]
    args: tuple[str, ...] = ()
    again: bool = False  # after the chain, run the finished run once more (it must log nothing twice)
    launcher: tuple[str, ...] = ()  # options for `accelerate launch` itself


# One chain of faults per cell, one launch each, then a launch to the end. Each event's range lies
# after the previous one's (a launcher's signal takes a step or two to arrive: a gap of 3), so every
# restart resumes before the next fault strikes. Checkpoints: image every 2 steps and at each epoch
# end (7 steps on one process, 4 on two); language model every 3 steps and at the evaluations (5, 10, 14);
# fine-tuning every 3 steps and at the evaluations (6, 12). Every template meets a NaN loss in one cell.
CELLS = {
    "image-1proc": Cell(IMAGE, None, (Event("kill", 0, 2, 4), Event("nan_loss", 1, 5, 6), Event("enospc", 2, 7, 9),
                                      Event("kill_save", 3, 10, 12)),
                        args=("--log_every_steps", "3"), again=True),  # logs off the checkpoint grid (every 2)
    "image-ddp": Cell(IMAGE, "cpu_ddp.yaml", (Event("kill", 4, 2, 3, rank=1), Event("enospc", 5, 4, 5, rank=1),
                                              Event("signal", 6, 6, 7, rank=1, signal="USR1"))),
    "image-fsdp": Cell(IMAGE, "fsdp.yaml", (Event("kill", 7, 2, 7, rank=0),)),
    "lm-1proc": Cell(LM, "cpu.yaml", (Event("kill", 8, 2, 3), Event("signal_launcher", 9, 4, 5),
                                      Event("enospc", 10, 9, 10), Event("nan_loss", 11, 11, 13)),
                     args=("--batch_size", "16"), again=True),
    "lm-ddp": Cell(LM, "cpu_ddp.yaml", (Event("signal_launcher", 12, 2, 4, rank=0),
                                        Event("kill_save", 13, 8, 12, rank=0)),
                   args=("--batch_size", "8", "--log_every_steps", "2")),  # off the checkpoint grid (every 3)
    "lm-fsdp": Cell(LM, "fsdp.yaml", (Event("kill", 14, 2, 6, rank=1), Event("kill_save", 15, 8, 12, rank=1)),
                    args=("--batch_size", "8")),
    "ft-1proc": Cell(FT, "cpu.yaml", (Event("kill", 16, 2, 4), Event("kill_save", 17, 7, 9),
                                      Event("nan_loss", 21, 10, 11))),
    "ft-lora-1proc": Cell(FT, "cpu.yaml", (Event("kill", 18, 4, 8), Event("nan_loss", 22, 10, 11)), args=FT_LORA),
    "ft-fsdp": Cell(FT, "fsdp.yaml", (Event("kill", 19, 2, 6, rank=1),), launcher=LLAMA_UNITS),
    "ft-fsdp-lora": Cell(FT, "fsdp.yaml", (Event("kill", 20, 4, 8, rank=0),), args=FT_LORA, launcher=LLAMA_UNITS),
}


# fp16 on the CPU with a loss scaler and an inf loss at step 3, per template: (template, options beyond the
# cell's, optimizer steps of the run, --stop_after_steps of a first launch that a second resumes, or None)
FP16 = {"image": (IMAGE, (), 14, 5), "lm": (LM, ("--batch_size", "16"), 14, None), "ft": (FT, (), 12, None)}


def cells_with(*faults: str) -> list[str]:
    return [name for name, cell in CELLS.items() if any(e.fault in faults for e in cell.events)]


# ------------------------------------------------------------------------------------- running
@dataclass
class Launch:
    result: subprocess.CompletedProcess
    records: dict[int, dict]  # rank -> what tests/fault_inject.py recorded
    saves: dict[str, dict]  # checkpoints published in this launch, as they were right after the save
    checkpoints: list[str]  # what the checkpoint folder held afterwards
    progress: dict[str, int]  # and the step each complete one recorded
    digests: dict[str, dict]  # and each complete one's files and folders (helpers.snapshot)
    left_running: list[str]
    seconds: float
    status: dict | None = None  # <output_dir>/status.json afterwards
    event: Event | None = None
    step: int | None = None

    @property
    def output(self) -> str:
        return self.result.stdout + self.result.stderr


def show(launch: Launch) -> str:
    return (f"exit {launch.result.returncode}\n--- stdout ---\n{launch.result.stdout[-3000:]}\n"
            f"--- stderr ---\n{launch.result.stderr[-4000:]}")


def command(template: Path, config: str | None, args: list[str], wrapped: bool,
            launcher: tuple[str, ...] = ()) -> list[str]:
    script = [str(INJECT), str(template)] if wrapped else [str(template)]
    if config is None:
        return [sys.executable, *script, *args]
    processes = ["--num_processes", "2"] if config != "cpu.yaml" else []
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config), *processes,
            "--main_process_port", str(free_port()), *launcher, *script, *args]


def run(template: Path, config: str | None, out: Path, args: tuple[str, ...], fault: dict[str, str] | None = None,
        timeout: float = 300, launcher: tuple[str, ...] = ()) -> Launch:
    record = out.parent / f"records-{out.name}-{time.monotonic_ns()}"
    env = clean_env(**({k: str(v) for k, v in fault.items()} | {"FAULT_RECORD": str(record)} if fault else {}))
    started = time.monotonic()
    result = run_to_end(command(template, config, [*args, "--output_dir", str(out)], wrapped=fault is not None,
                                launcher=launcher), cwd=REPO, env=env, timeout=timeout)
    seconds = time.monotonic() - started
    records = read_records(record)
    saves = json.loads((record / "saves.json").read_text()) if (record / "saves.json").is_file() else {}
    folder = out / "checkpoints"
    checkpoints = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    progress = {name: json.loads((folder / name / "progress.json").read_text())["step"]
                for name in checkpoints if (folder / name / "progress.json").is_file()}
    digests = {name: snapshot(folder / name) for name in progress}
    return Launch(result, records, saves, checkpoints, progress, digests, wait_for_no_processes(str(out)), seconds,
                  read_status(out))


def cell_args(cell: Cell, corpus: Path) -> tuple[str, ...]:
    if cell.template == FT:  # the fixture writes the tiny model and its data beside the corpus
        return (*FT_ARGS, "--model", str(corpus.parent / "tiny_model"),
                "--data_path", str(corpus.parent / "reverse.jsonl"),
                *cell.args)
    if cell.template == LM:
        return (*LM_ARGS, "--data_path", str(corpus), *cell.args)
    return (*IMAGE_ARGS, *cell.args)


@dataclass
class Chain:
    baseline: Launch
    launches: list[Launch] = field(default_factory=list)  # one per event, then the final one
    out: Path | None = None
    again: tuple[Launch, bytes] | None = None  # a resume of the finished run, and metrics.jsonl before it


def run_chain(name: str, root: Path, corpus: Path) -> Chain:
    cell = CELLS[name]
    args = cell_args(cell, corpus)
    baseline = run(cell.template, cell.config, root / "baseline", args, launcher=cell.launcher)
    chain = Chain(baseline=baseline, out=root / "run")
    for event in cell.events:
        fault = {"FAULT": event.fault, "FAULT_STEP": event.step, "FAULT_RANK": event.rank, "FAULT_SIGNAL": event.signal}
        launch = run(cell.template, cell.config, chain.out, args, fault, launcher=cell.launcher)
        launch.event, launch.step = event, event.step
        chain.launches.append(launch)
    # to the end, --resume auto (the default)
    chain.launches.append(run(cell.template, cell.config, chain.out, args, launcher=cell.launcher))
    if cell.again:
        logged = (chain.out / "metrics.jsonl").read_bytes()
        chain.again = (run(cell.template, cell.config, chain.out, args, launcher=cell.launcher), logged)
    return chain


def one_run(template: Path, config: str | None, root: Path, args: tuple[str, ...], fault: dict | None = None) -> Launch:
    return run(template, config, root / "run", args, fault)


def hung_rank(root: Path) -> dict:
    """Rank 1 of 2 stops (SIGSTOP) before step 3; rank 0 must give up after --timeout_s 10 and say so."""
    out, record = root / "run", root / "records"
    env = clean_env(FAULT="stop", FAULT_STEP="3", FAULT_RANK="1", FAULT_RECORD=str(record))
    argv = command(IMAGE, "cpu_ddp.yaml",
                   [*IMAGE_ARGS, "--num_workers", "0", "--timeout_s", "10", "--output_dir", str(out)], wrapped=True)
    launcher = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: dict[int, int] = {}
    stopped_at = ended_at = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and ended_at is None and launcher.poll() is None:
            pids = {rank: r["pid"] for rank, r in read_records(record).items()}
            if stopped_at is None and 1 in pids and process_state(pids[1]) == "T":
                stopped_at = time.monotonic()
            if stopped_at is not None and process_state(pids[0]) in (None, "Z"):
                ended_at = time.monotonic()
            time.sleep(0.05)
    finally:
        for pid in pids.values():  # the stopped rank: what the launcher would do 30 s later
            if process_state(pid) not in (None, "Z"):
                os.kill(pid, signal.SIGKILL)
        try:
            stdout, stderr = launcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            stdout, stderr = launcher.communicate()
    return {"waited": None if stopped_at is None or ended_at is None else ended_at - stopped_at, "stdout": stdout,
            "stderr": stderr, "records": read_records(record), "returncode": launcher.returncode,
            "left": wait_for_no_processes(str(out)), "status": read_status(out)}


def read_records(folder: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in folder.glob("rank*.json")}


def process_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    """Every run of this module, two at a time; each test reads the ones it is about."""
    root = tmp_path_factory.mktemp("faults")
    corpus = write_tiny_corpus(root / "tiny.txt")
    sys.path.insert(0, str(REPO / "scripts"))
    from make_tiny_model import reverse_task

    (root / "tiny_model").symlink_to(tiny_model)  # what cell_args names for the fine-tuning cells
    (root / "reverse.jsonl").write_text("".join(json.dumps(e) + "\n" for e in reverse_task(120)))

    def job(name: str, root: Path):
        root.mkdir(parents=True)
        if name in CELLS:
            return run_chain(name, root, corpus)
        if name == "hung-rank":
            return hung_rank(root)
        if name.startswith("fp16"):  # the image run stops after 5 steps and resumes, still on fp16 with its scaler
            template, extra, _, stop_after = FP16[name.removeprefix("fp16-")]
            args = cell_args(Cell(template, None, (), args=extra), corpus)
            stop = ("--stop_after_steps", str(stop_after)) if stop_after else ()
            first = one_run(template, None, root, (*args, *stop), {"FAULT": "inf_loss", "FAULT_STEP": 3})
            again = one_run(template, None, root, args, {"FAULT": "inf_loss", "FAULT_STEP": 0}) if stop else None
            return first, again
        raise AssertionError(name)

    # The hung rank mostly waits: it starts first, beside the longest chain.
    order = ["hung-rank", "lm-1proc", "image-ddp", "lm-ddp", "lm-fsdp", "image-fsdp", "image-1proc",
             *[f"fp16-{template}" for template in FP16], "ft-fsdp", "ft-1proc", "ft-fsdp-lora", "ft-lora-1proc"]
    if os.environ.get("FAULT_JOBS"):  # e.g. FAULT_JOBS=image-ddp,hung-rank: only these (the other tests then fail)
        order = [name for name in order if name in os.environ["FAULT_JOBS"].split(",")]

    def safe(name):
        try:
            return job(name, root / name)
        except Exception as error:  # reported by the tests that need this run
            return error

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(order, pool.map(safe, order)))
    return results


def get(runs, name):
    result = runs.get(name, LookupError(f"{name} was not run (FAULT_JOBS)"))
    if isinstance(result, Exception):
        raise result
    return result


# ------------------------------------------------------------------------------------- helpers
def deterministic(records: list[dict]) -> list[dict]:
    return [{k: r[k] for k in ("step", *DETERMINISTIC) if k in r} for r in records]


def resumed_step(launch: Launch) -> int | None:
    match = re.search(r"resumed from \S+ at step (\d+)", launch.result.stdout)
    return int(match.group(1)) if match else None


PROGRESS_BAR = re.compile(r"^train:\s+\d+%\|")


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def newest(launch: Launch) -> str:
    """The checkpoint `--resume auto` takes: the highest step, the periodic one before the best at a step."""
    return max(launch.progress, key=lambda name: (launch.progress[name], name.startswith("step_")))


def assert_checkpoints_untouched(chain: Chain, launch: Launch) -> None:
    """What this launch saved before the fault, and what earlier launches saved, is as it was right after its save."""
    before = chain.launches[chain.launches.index(launch) - 1].digests if chain.launches.index(launch) else {}
    assert launch.saves or before, "there should be checkpoints from before the fault"
    for name, files in {**before, **launch.saves}.items():
        if name in launch.digests:  # keep_last may have deleted the oldest, as in any run
            assert launch.digests[name] == files, name


# ---------------------------------------------------------------------------- killed and resumed
@pytest.mark.parametrize("name", list(CELLS))
def test_interrupted_run_ends_bit_identical_to_an_uninterrupted_one(runs, name):
    chain = get(runs, name)
    assert chain.baseline.result.returncode == 0, show(chain.baseline)
    final = chain.launches[-1]
    assert final.result.returncode == 0, show(final)
    base, out = Path(chain.baseline.result.args[-1]), chain.out  # the command's last word is its --output_dir
    reference, resumed = load_file(exported_weights(base)), load_file(exported_weights(out))
    assert sorted(reference) == sorted(resumed)
    assert [k for k in reference if not torch.equal(reference[k], resumed[k])] == []
    # The same metrics at every step too: lines after a resumed checkpoint were dropped and written again.
    assert deterministic(read_metrics(out)) == deterministic(read_metrics(base))
    assert final.left_running == [] and not list((out / "checkpoints").glob(".tmp-*"))
    if chain.again is not None:  # resuming the finished run reports it again and logs nothing twice
        again, logged = chain.again
        assert again.result.returncode == 0 and "resumed from" in again.result.stdout, show(again)
        assert (out / "metrics.jsonl").read_bytes() == logged
        assert again.status["state"] == "finished"


def exported_weights(out: Path) -> str:
    """The export's weights: the templates' model.safetensors, or a fine-tuned model's (or LoRA adapter's) in model/."""
    candidates = [out / "model.safetensors", out / "model" / "model.safetensors",
                  out / "model" / "adapter_model.safetensors"]
    return str(next((path for path in candidates if path.is_file()), candidates[0]))


def faults(chain: Chain, *kinds: str):
    """(launch, the launch after it, the step drawn) for each event of these kinds."""
    return [(first, following, first.step) for first, following in zip(chain.launches, chain.launches[1:])
            if first.event.fault in kinds]


def one_error_line(launch: Launch, direct: bool) -> str:
    """The template's `error:` line; run directly (not under accelerate launch) it is all of stderr."""
    lines = sorted(set(error_lines(launch.result.stderr)))  # accelerate's own report repeats the child's stderr
    assert len(lines) == 1, show(launch)
    if direct:  # nothing else on stderr but the progress bar it closed first
        rest = [line for line in re.split(r"[\r\n]+", launch.result.stderr)
                if line.strip() and not PROGRESS_BAR.match(line)]
        assert rest == lines, show(launch)
        assert "Traceback" not in launch.output
    return lines[0]


@pytest.mark.parametrize("name", cells_with("kill", "kill_save"))
def test_sigkill_at_a_drawn_step_or_mid_save_and_the_restart_resumes_before_it(runs, name):
    chain = get(runs, name)
    for launch, following, step in faults(chain, "kill", "kill_save"):
        event = launch.event
        assert launch.result.returncode != 0 and launch.left_running == [], show(launch)
        acting = launch.records[event.rank]
        assert acting["exit_code"] is None, acting  # it died by SIGKILL: no exit of its own
        for rank, other in launch.records.items():  # stopped by the launcher, or noticed the loss and said so
            # (an exit 1 here, seen under heavy load, was the launcher's SIGTERM killing a loader worker in its first
            # moments, fixed by common.data.worker_context: the error and output in full, should another appear)
            assert rank == event.rank or other["exit_code"] in (None, 5), f"{other}\n{show(launch)}"
        if event.fault == "kill":
            assert acting["steps_done"] == step - 1, (event, step, acting)
            assert (resumed_step(following) or 0) < step, following.result.stdout
            continue
        # kill_save: the interrupted save is reported, ignored, and the checkpoint before it used
        tmp = [name for name in launch.checkpoints if name.startswith(".tmp-")]
        assert len(tmp) == 1, launch.checkpoints
        interrupted = int(tmp[0].rsplit("_", 1)[1])
        # Written in the background: training went on while the save of step `interrupted` was being written.
        assert step <= interrupted <= acting["steps_done"], (step, tmp, acting)
        ignored = chain.out / "checkpoints" / tmp[0]
        assert f"ignoring incomplete checkpoint {ignored} (its save was interrupted)" in following.result.stdout
        assert resumed_step(following) is not None and resumed_step(following) < interrupted, following.result.stdout


@pytest.mark.parametrize("name", cells_with("signal", "signal_launcher"))
def test_preemption_signal_stops_every_rank_at_one_step_with_a_checkpoint_and_exit_75(runs, name):
    chain = get(runs, name)
    for launch, following, step in faults(chain, "signal", "signal_launcher"):
        event = launch.event
        assert launch.records, show(launch)
        assert all(r["exit_code"] == 75 for r in launch.records.values()), (launch.records, show(launch))
        stopped = {r["steps_done"] for r in launch.records.values()}
        assert len(stopped) == 1, launch.records  # every rank stopped after the same step
        stop = stopped.pop()
        if event.fault == "signal":  # sent to one rank only, just before this step: the ranks finish it, then stop
            assert stop == step, (step, launch.records)
        else:  # the launcher passes it on while the ranks train: they stop a step or so later, before the next fault
            later = [each.event.low for each in chain.launches[chain.launches.index(launch) + 1:-1]]
            assert step <= stop < min(later, default=math.inf), (step, stop)
        if CELLS[name].config is None:
            assert launch.result.returncode == 75
        # Every rank learns which signal stopped the job, also from another rank (rank 0 prints the line).
        stopped_line = f"stopped at step {stop} by SIG{event.signal} (preemption); checkpoint saved"
        assert stopped_line in launch.result.stderr, show(launch)  # exit 75: on stderr, which launchers show
        periodic = [n for n in launch.checkpoints if n.startswith("step_")]
        assert periodic[-1] == f"step_{stop:08d}" and launch.progress[periodic[-1]] == stop, launch.checkpoints
        assert not [n for n in launch.checkpoints if n.startswith(".tmp-")]
        assert launch.left_running == []  # loader workers included
        assert resumed_step(following) == stop, following.result.stdout


@pytest.mark.parametrize("name", cells_with("enospc"))
def test_full_disk_during_a_save_stops_every_rank_with_one_line_and_keeps_the_previous_checkpoints(runs, name):
    chain = get(runs, name)
    for launch, following, step in faults(chain, "enospc"):
        assert {r["exit_code"] for r in launch.records.values()} == {4}, (launch.records, show(launch))
        assert launch.seconds < 120  # every rank learned of it at once, none waited for --timeout_s (600)
        line = one_error_line(launch, direct=CELLS[name].config is None)
        failed = re.match(r"error: saving checkpoint (\S+) failed: \[Errno 28\] No space left on device: "
                          r"\S+( \(on rank 1\))?; the previous checkpoints are intact \(newest: (\S+)\), "
                          r"and the incomplete (\S+) is ignored on resume$", line)
        assert failed, line
        assert bool(failed.group(2)) == (launch.event.rank == 1)  # names the rank whose disk was full
        failed_step = int(failed.group(1).rsplit("_", 1)[1])
        assert failed_step >= step and Path(failed.group(1)).name not in launch.progress  # nothing published for it ...
        assert failed.group(4) == f".tmp-{Path(failed.group(1)).name}" and failed.group(4) in launch.checkpoints
        assert failed.group(3) == newest(launch)
        assert_checkpoints_untouched(chain, launch)  # ... and what was saved before is as it was
        ignored = chain.out / "checkpoints" / failed.group(4)
        assert f"ignoring incomplete checkpoint {ignored}" in following.result.stdout
        assert resumed_step(following) == launch.progress[newest(launch)], following.result.stdout
        assert launch.left_running == []


@pytest.mark.parametrize("name", cells_with("nan_loss"))
def test_nan_loss_stops_naming_the_step_and_the_last_good_checkpoint_stays_intact(runs, name):
    chain = get(runs, name)
    for launch, following, step in faults(chain, "nan_loss"):
        assert {r["exit_code"] for r in launch.records.values()} == {3}, (launch.records, show(launch))
        line = one_error_line(launch, direct=CELLS[name].config is None)
        assert line.startswith(f"error: non-finite gradients at step {step} "), line
        assert "the last good checkpoint is kept" in line, line
        assert max(launch.progress.values()) < step and not [n for n in launch.checkpoints if n.startswith(".tmp-")]
        assert_checkpoints_untouched(chain, launch)
        assert resumed_step(following) == launch.progress[newest(launch)]
        assert launch.left_running == []


# ---------------------------------------------------------------------------------- the end state
# What status.json says after each launch of each chain, whatever exit code the launcher turned it into.
END_STATE = {"kill": ("running", None), "kill_save": ("running", None), "signal": ("preempted", 75),
             "signal_launcher": ("preempted", 75), "enospc": ("failed", 4), "nan_loss": ("failed", 3)}


@pytest.mark.parametrize("name", list(CELLS))
def test_status_json_says_how_every_launch_ended(runs, name):
    chain = get(runs, name)
    for launch in chain.launches[:-1]:
        state, code = END_STATE[launch.event.fault]
        if launch.event.fault.startswith("kill") and launch.event.rank != 0:  # the main process lives on and notices
            state, code = "failed", 5
        assert launch.status is not None and launch.status["state"] == state, (launch.event, launch.status)
        if state == "running":  # SIGKILLed: nothing could write more; a reader knows the run crashed, and its step
            # is where a resume continues: the start or a complete checkpoint (the newest, unless it was killed
            # between publishing one and recording it: tested without that race on its own below)
            assert launch.status["step"] in {0, resumed_step(launch), *launch.progress.values()}, launch.status
            continue
        assert launch.status["exit_code"] == code, launch.status
        if state == "failed":
            assert error_lines(launch.output)[0] == f"error: {launch.status['error']}", launch.status
        else:
            assert launch.status["step"] == max(r["steps_done"] for r in launch.records.values()), launch.status
        if CELLS[name].config is not None:  # what the launcher made of it: 1, or 143 when it got the SIGTERM
            assert launch.result.returncode == (143 if launch.event.fault == "signal_launcher" else 1), show(launch)
    for launch in (chain.baseline, chain.launches[-1]):
        assert launch.status["state"] == "finished" and launch.status["exit_code"] == 0, launch.status
        assert launch.result.returncode == 0


@pytest.mark.parametrize("name", [name for name, cell in CELLS.items() if cell.config not in (None, "cpu.yaml")])
def test_only_the_main_process_writes_status_json(runs, name):
    """On 2 ranks rank 0 alone writes status.json (tests/fault_inject.py counts each rank's writes as they
    happen): two writers would race their renames, and the loser's record would be lost."""
    chain = get(runs, name)
    for launch in chain.launches[:-1]:  # the launches with a fault, run through tests/fault_inject.py
        writes = {rank: record["status_writes"] for rank, record in launch.records.items()}
        assert sorted(writes) == [0, 1] and writes[0] >= 1 and writes[1] == 0, (launch.event, writes, show(launch))


def test_status_json_of_a_killed_run_says_the_step_a_resume_continues_from(tmp_path):
    """SIGKILL just before step 6 (checkpoints at steps 2 and 4, written at the step so the test cannot race
    the writer): status.json still says "running", and its step is 4, the last complete checkpoint, where the
    restart continues."""
    args = (*IMAGE_ARGS, "--checkpoint_background", "false")
    killed = one_run(IMAGE, "cpu.yaml", tmp_path, args, {"FAULT": "kill", "FAULT_STEP": 6})
    assert killed.records[0]["steps_done"] == 5, show(killed)
    assert (killed.status["state"], killed.status["step"]) == ("running", 4), killed.status
    assert killed.progress[newest(killed)] == 4
    again = one_run(IMAGE, "cpu.yaml", tmp_path, (*args, "--stop_after_steps", "1"))
    assert resumed_step(again) == 4, show(again)
    assert (again.status["state"], again.status["step"]) == ("stopped", 5), again.status


# ------------------------------------------------------------------------------- one rank alone
# A scheduler may signal one task of a job, and a gradient may turn non-finite on one rank: every rank must still
# stop at the same step with the same exit code, which only the agreement of PreemptionWatcher.check_step gives.
# One epoch of the image template (4 steps on each of 2 ranks), checkpoints at step 2; the fault strikes at step 3.
# Without the all-reduce in check_step (each rank deciding alone) the rank that got the signal or the non-finite
# gradient stops while the other trains on: exits 5 and 3 or 75, after --timeout_s at most. A rank that ignores
# another's signal (agrees to stop but does not adopt it) exits 0 beside a 75. Measured: ~25 s a case on 2 cores.
ALONE_ARGS = (*IMAGE_ARGS, "--epochs", "1", "--num_workers", "0", "--timeout_s", "15")
ALONE = {  # the signal to rank 1 of 2 DDP ranks is the image-ddp chain's; here the other rank and FSDP
    "signal-rank0-ddp": ("signal", 0, "cpu_ddp.yaml"),
    "signal-rank1-fsdp": ("signal", 1, "fsdp.yaml"),
    # Under DDP the gradients are averaged in the backward pass, so a NaN loss on one rank is NaN on all: the
    # gradient is made non-finite after that, on one rank, as a fault of that rank's memory would.
    "nan-grad-rank1-ddp": ("nan_grad", 1, "cpu_ddp.yaml"),
    # Under FSDP2 the NaN is in one rank's shard; the norm, reduced over the shards, is NaN on every rank anyway.
    "nan-grad-rank0-fsdp": ("nan_grad", 0, "fsdp.yaml"),
}


@pytest.mark.parametrize("case", list(ALONE))
def test_a_fault_on_one_rank_alone_stops_every_rank_at_the_same_step_with_the_same_exit_code(tmp_path, case):
    fault, rank, config = ALONE[case]
    launch = one_run(IMAGE, config, tmp_path, ALONE_ARGS,
                     {"FAULT": fault, "FAULT_STEP": 3, "FAULT_RANK": rank, "FAULT_SIGNAL": "USR1"})
    assert sorted(launch.records) == [0, 1], show(launch)
    exits = {r["exit_code"] for r in launch.records.values()}
    stopped = {r["steps_done"] for r in launch.records.values()}
    events = launch.records[0]["events"]  # what rank 0, which publishes the checkpoints, did
    assert launch.left_running == []
    if fault == "signal":  # every rank finishes step 3, checkpoints it once, and exits 75 to be requeued
        assert exits == {75} and stopped == {3}, (launch.records, show(launch))
        assert "stopped at step 3 by SIGUSR1 (preemption); checkpoint saved" in launch.result.stderr, show(launch)
        assert launch.checkpoints == ["step_00000002", "step_00000003"] and launch.progress["step_00000003"] == 3
        assert events.count("published step_00000003") == 1, events
        assert (launch.status["state"], launch.status["step"], launch.status["exit_code"]) == ("preempted", 3, 75)
    else:  # no rank applies step 3; every rank exits 3, and the checkpoint of step 2 is the last
        assert exits == {3} and stopped == {2}, (launch.records, show(launch))
        line = one_error_line(launch, direct=False)
        assert line.startswith("error: non-finite gradients at step 3 "), line
        assert line.endswith(f"the last good checkpoint is kept: {tmp_path / 'run' / 'checkpoints' / 'step_00000002'}")
        assert launch.checkpoints == ["step_00000002"], launch.checkpoints
        assert (launch.status["state"], launch.status["exit_code"]) == ("failed", 3), launch.status


# --------------------------------------------------------------------- the export after the checkpoint
@pytest.fixture
def reverse_data(tmp_path, tiny_model) -> tuple[str, ...]:
    """The fine-tuning template's options for the tiny model on 120 reverse-a-word examples."""
    sys.path.insert(0, str(REPO / "scripts"))
    from make_tiny_model import reverse_task

    data = tmp_path / "reverse.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in reverse_task(120)))
    return "--model", str(tiny_model), "--data_path", str(data)


@pytest.mark.parametrize("template", ["image", "lm", "finetune"])
def test_the_export_waits_for_the_last_checkpoint_written_in_the_background(tmp_path, request, template):
    """The last checkpoint (step 7 of the image run, at the epoch's end; step 4 of the other runs, at their
    evaluation) is written in the background, and its write is held back (tests/fault_inject.py `slow_save`)
    until the template starts its export, or 5 s: a template that waits for the save (`ckpt.wait()`) exports
    after the checkpoint is published; one that does not exports while it is still being written. One process,
    run directly: ~15 s (image, language model) and ~20 s (fine-tuning) on 2 cores."""
    if template == "image":
        script, args, last = IMAGE, (*IMAGE_ARGS, "--epochs", "1", "--num_workers", "0"), 7
    elif template == "lm":
        script, last = LM, 4
        args = (*LM_ARGS, "--data_path", str(write_tiny_corpus(tmp_path / "tiny.txt")), "--max_steps", str(last),
                "--num_workers", "0", "--sample_tokens", "0")
    else:
        script, last = FT, 4
        args = (*FT_ARGS, *request.getfixturevalue("reverse_data"), "--max_steps", str(last), "--num_workers", "0",
                "--sample_tokens", "0")
    launch = one_run(script, None, tmp_path, args, {"FAULT": "slow_save", "FAULT_STEP": last})
    assert launch.result.returncode == 0, show(launch)
    events = launch.records[0]["events"]
    assert f"published step_{last:08d}" in events and events[-1] == "export", events  # the export came last
    assert events.count("export") == 1 and launch.progress[f"step_{last:08d}"] == last
    assert Path(exported_weights(tmp_path / "run")).is_file()


# ------------------------------------------------------------------------------------ a hung rank
def test_hung_rank_ends_the_job_within_timeout_s_with_one_clear_line(runs):
    hung = get(runs, "hung-rank")
    assert hung["waited"] is not None, hung["stderr"][-3000:]
    assert 9 <= hung["waited"] <= 10 + 20, hung["waited"]  # --timeout_s 10, and not much later
    assert hung["records"][0]["exit_code"] == 5, hung["records"]
    lines = error_lines(hung["stderr"])
    expected = "error: rank 0: another rank died or did not answer within --timeout_s ("
    assert lines and lines[0].startswith(expected), hung["stderr"][-3000:]
    assert "Timed out waiting 10000ms" in lines[0] and "resume with --resume auto" in lines[0]
    assert hung["returncode"] != 0 and hung["left"] == []
    assert hung["status"]["state"] == "failed" and hung["status"]["exit_code"] == 5, hung["status"]
    assert f"error: {hung['status']['error']}" == lines[0]


# ----------------------------------------------------------------------------------- fp16 overflow
@pytest.mark.parametrize("template", list(FP16))
def test_fp16_overflow_is_skipped_by_the_scaler_counted_and_training_goes_on(runs, template):
    """fp16 on the CPU: tests/fault_inject.py attaches torch.amp.GradScaler("cpu"), as accelerate does on GPUs."""
    first, second = get(runs, f"fp16-{template}")
    steps = FP16[template][2]
    out = Path(first.result.args[-1])
    assert first.result.returncode == 0, show(first)
    # skipped steps are no failure: the run ends as any other (the image run stopped for its resume first)
    assert first.status["state"] == ("finished" if second is None else "stopped"), first.status
    if second is not None:
        assert second.result.returncode == 0 and "resumed from" in second.result.stdout, show(second)
        assert second.status["state"] == "finished" and second.status["exit_code"] == 0, second.status
    logged = {r["step"]: r for r in read_metrics(out) if "train/skipped_steps" in r}
    assert sorted(logged) == list(range(1, steps + 1))
    # counted (image: over a resume)
    assert [logged[s]["train/skipped_steps"] for s in range(1, steps + 1)] == [0, 0] + [1] * (steps - 2)
    assert logged[3]["train/loss"] is None  # the inf, written as null
    assert all(logged[s]["train/loss"] is not None and math.isfinite(logged[s]["train/loss"]) for s in logged if s != 3)
    # the scaler's state is checkpointed
    assert all((p / "scaler.pt").is_file() for p in (out / "checkpoints").iterdir())
    weights = load_file(exported_weights(out))
    assert all(torch.isfinite(t).all() for t in weights.values())
