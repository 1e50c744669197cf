"""Test helper, launched in place of a template: run the template's own main() with one fault injected.

    FAULT=kill FAULT_STEP=7 [FAULT_RANK=1] [FAULT_RECORD=dir] python tests/fault_inject.py templates/x.py --opt ...
    (or the same under `accelerate launch`)

The template module is imported from its file and runs unchanged; the wrapper only watches
`torch.optim.AdamW.step` to count optimizer steps (global: the step the run resumed from plus the
steps of this session) and, on the chosen rank (default: every rank), at FAULT_STEP:

    kill       SIGKILL this process just before it takes optimizer step FAULT_STEP
    kill_save  SIGKILL it in the middle of the first checkpoint save at a step >= FAULT_STEP: the
               real files are written, then the biggest one this rank wrote is cut to half, then SIGKILL
    signal     send FAULT_SIGNAL (TERM or USR1) to this process just before step FAULT_STEP;
               the template must finish that step on every rank, checkpoint it and exit 75
    signal_launcher  send FAULT_SIGNAL to the parent process, the launcher (torchrun's agent or
               accelerate's single-process launcher), which passes it on to every training process
               (and their loader workers) in its own way; they stop at a step >= FAULT_STEP
    signal_group  send FAULT_SIGNAL to this process's whole process group (a terminal's Ctrl-C, `kill -- -PGID`,
               `scancel`): the launcher, every rank and their loader workers at once
               (the three signal faults with FAULT_STEP=0: at the start of the session's first evaluation, the
               fine-tuning template's evaluation before training, which then lasts FAULT_SLOW_S seconds longer,
               as a real model's does: longer than a launcher waits for a rank it passed a stop to)
    stop       SIGSTOP this process just before step FAULT_STEP: a rank that hangs
    enospc     the first checkpoint save at a step >= FAULT_STEP writes part of a file, then fails
               with OSError(ENOSPC) on this rank
    inf_loss   fp16 on the CPU: a torch.amp.GradScaler("cpu") is attached to the accelerator (accelerate
               makes none on CPU) and the loss of the first micro-batch of step FAULT_STEP is inf
    nan_loss   the loss of the first micro-batch of step FAULT_STEP is NaN (no scaler)
    nan_grad   after the backward passes of step FAULT_STEP (the gradients synchronised across ranks), just
               before clipping, the biggest gradient of this process is made NaN: a non-finite gradient on
               this rank alone (under DDP the other ranks' gradients stay finite)
    signal_at_exit  send FAULT_SIGNAL to the whole process group as the first loader's workers are shut down (at
               main()'s end) and again from an exit handler, each then taking 2 s more (a slow teardown); FAULT_STEP
               is not used
    slow_save  the write phase of the first checkpoint save at a step >= FAULT_STEP (in the background: the
               writer thread) waits until the template starts its export, or FAULT_SLOW_S seconds (default 5):
               a template that exports without waiting for the save shows it in `events`

FAULT_RECORD names a folder where each rank writes rank<R>.json at start (pid, the step it resumed
from), after each write of status.json (how many it made: `status_writes`) and again at exit (exit code,
the last optimizer step it finished); rank 0 also writes
saves.json: for every checkpoint this session published, its files and folders as they were right
after the save (tests/helpers.py `snapshot`: inode, size, mtime and sha256). `events`, in rank<R>.json, is what
this process did in order: "published <checkpoint name>" (the main process) and "export" (when the template's
export function was called).
"""

from __future__ import annotations

import atexit
import errno
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from helpers import snapshot  # tests/helpers.py, beside this file

template_path = Path(sys.argv[1]).resolve()
argv = sys.argv[2:]
sys.path.insert(0, str(template_path.parent.parent))  # common/ of the repository under test
spec = importlib.util.spec_from_file_location(f"faulty_{template_path.stem}", template_path)
template = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = template  # dataclasses look their module up while the file runs
spec.loader.exec_module(template)

FAULT = os.environ.get("FAULT", "")
AT = int(os.environ.get("FAULT_STEP", "0"))
RANK = int(os.environ.get("RANK", "0"))
ACTS = os.environ.get("FAULT_RANK", str(RANK)) == str(RANK)
RECORD = Path(os.environ["FAULT_RECORD"]) if os.environ.get("FAULT_RECORD") else None
state = {"pid": os.getpid(), "rank": RANK, "resumed_step": None, "steps_done": None, "exit_code": None,
         "status_writes": 0, "events": []}


def write_json(path: Path, data: dict) -> None:
    """Whole or not at all: the test may read it at any moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


record_lock = threading.Lock()  # the background writer records too (its status.json writes): one at a time


def record() -> None:
    if RECORD is not None:
        with record_lock:
            write_json(RECORD / f"rank{RANK}.json", state)


def global_step() -> int:
    """The optimizer step about to be taken (1-based), counted over resumes."""
    return (state["resumed_step"] or 0) + calls["steps"] + 1


def event(what: str) -> None:
    with record_lock:
        state["events"].append(what)
    record()


def die() -> None:
    record()  # where it stood when it died
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


calls = {"steps": 0, "fired": False, "resuming": False}

# --- the resumed step, from the checkpoint manager the template uses
real_resume = template.CheckpointManager.resume


def resume(self, *args, **kwargs):
    calls["resuming"] = True
    try:
        progress = real_resume(self, *args, **kwargs)
    finally:
        calls["resuming"] = False
    state["resumed_step"] = state["steps_done"] = progress.step
    record()
    return progress


template.CheckpointManager.resume = resume

# --- optimizer steps
real_step = torch.optim.AdamW.step


def step(self, *args, **kwargs):
    if calls["resuming"]:  # FSDP's optimizer-state loading takes a step with lr 0 to create the state: not training
        return real_step(self, *args, **kwargs)
    if ACTS and not calls["fired"] and global_step() == AT:
        if FAULT == "kill":
            die()
        elif FAULT == "stop":
            calls["fired"] = True
            os.kill(os.getpid(), signal.SIGSTOP)
    result = real_step(self, *args, **kwargs)
    calls["steps"] += 1
    state["steps_done"] = (state["resumed_step"] or 0) + calls["steps"]
    return result


torch.optim.AdamW.step = step
real_clip = Accelerator.clip_grad_norm_


def wait_for_the_launcher(timeout_s: float = 5.0) -> None:
    """After a signal to the process group: wait until W&B's service, where it is a child of this process, has gone.
    accelerate's single-process launcher answers the signal by terminating every descendant of this process; the run
    goes on once it has (the moment of a real signal when the run's next step is slower than the launcher)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(b"wandb-core" in command for command in children_commands()):
        time.sleep(0.05)


def children_commands() -> list[bytes]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if entry.name.isdigit() and int(stat[1]) == os.getpid() and stat[0] not in ("Z", "X"):
                found.append((entry / "cmdline").read_bytes())
        except (OSError, IndexError):
            continue
    return found


SIGNAL_FAULTS = ("signal", "signal_launcher", "signal_group")


def signal_the_group() -> None:
    """FAULT_SIGNAL to this process's whole process group, from another process, as a terminal's or scancel's (the
    workers know the pid)."""
    subprocess.run(["sh", "-c", f"kill -s {os.environ.get('FAULT_SIGNAL', 'TERM')} -- -{os.getpgid(0)}"], check=False)


def send_stop_signal() -> None:
    calls["fired"] = True
    signum = getattr(signal, "SIG" + os.environ.get("FAULT_SIGNAL", "TERM"))
    if FAULT == "signal_group":
        signal_the_group()
        wait_for_the_launcher()
    else:
        os.kill(os.getpid() if FAULT == "signal" else os.getppid(), signum)


def clip_grad_norm_(self, parameters, *args, **kwargs):
    parameters = list(parameters)  # a generator (model.parameters()) is read here and by the real clip
    # A stop signal arrives during the step (here: after its backward passes, before the optimizer step). The
    # ranks agree on stop signals in the step's check before the optimizer step, so they stop after this one.
    if ACTS and not calls["fired"] and FAULT in SIGNAL_FAULTS and AT > 0 and global_step() == AT:
        send_stop_signal()
    if ACTS and not calls["fired"] and FAULT == "nan_grad" and global_step() == AT:
        calls["fired"] = True
        biggest = max((p for p in parameters if p.grad is not None), key=lambda p: p.numel())
        with torch.no_grad():
            biggest.grad.fill_(float("nan"))  # a DTensor under FSDP2: this rank's shard only
    return real_clip(self, parameters, *args, **kwargs)


Accelerator.clip_grad_norm_ = clip_grad_norm_

# --- the session's first evaluation (FAULT_STEP=0 of the signal faults): a stop signal during a long one
if hasattr(template, "evaluate"):
    def evaluate(*args, real_evaluate=template.evaluate, **kwargs):
        if ACTS and not calls["fired"] and FAULT in SIGNAL_FAULTS and AT == 0:
            send_stop_signal()
            time.sleep(float(os.environ.get("FAULT_SLOW_S", "5")))  # the evaluation of a real model goes on
        return real_evaluate(*args, **kwargs)

    template.evaluate = evaluate

# --- checkpoint saves: the write phase where each rank writes its part of the state (at the step or in the background)
real_write_state = template.CheckpointManager.write_state


def save_step(output_dir) -> int:
    return int(Path(output_dir).name.rsplit("_", 1)[-1])  # .tmp-step_00000012 / .tmp-best_step_00000012


export_started = threading.Event()


def write_state(self, output_dir, *args, **kwargs):
    if ACTS and not calls["fired"] and FAULT == "slow_save" and save_step(output_dir) >= AT:
        calls["fired"] = True
        export_started.wait(float(os.environ.get("FAULT_SLOW_S", "5")))  # a template that waits never sets it
    if ACTS and not calls["fired"] and FAULT in ("kill_save", "enospc") and save_step(output_dir) >= AT:
        calls["fired"] = True
        if FAULT == "enospc":
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            (Path(output_dir) / "model.safetensors").write_bytes(b"\0" * 1024)  # what fit before the disk filled
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(output_dir) / "model.safetensors"))
        before = set(Path(output_dir).rglob("*")) if Path(output_dir).exists() else set()
        result = real_write_state(self, output_dir, *args, **kwargs)
        written = [p for p in Path(output_dir).rglob("*") if p.is_file() and p not in before]
        if written:
            victim = max(written, key=lambda p: p.stat().st_size)
            with victim.open("r+b") as handle:
                handle.truncate(victim.stat().st_size // 2)
        die()
        return result
    return real_write_state(self, output_dir, *args, **kwargs)


template.CheckpointManager.write_state = write_state

# --- what each published checkpoint held right after its save (the publish phase)
real_publish = template.CheckpointManager.publish
saves: dict[str, dict] = {}


def publish(self, tmp, final, *args, **kwargs):
    real_publish(self, tmp, final, *args, **kwargs)
    event(f"published {final.name}")
    if RECORD is not None and RANK == 0:
        saves[final.name] = snapshot(final)
        write_json(RECORD / "saves.json", saves)


template.CheckpointManager.publish = publish

# --- the export: the template's own function (export_weights, imported into it, or the fine-tuning export_model)
for export_name in ("export_weights", "export_model"):
    if hasattr(template, export_name):
        def export(*args, real_export=getattr(template, export_name), **kwargs):
            event("export")
            export_started.set()
            return real_export(*args, **kwargs)

        setattr(template, export_name, export)

# --- status.json: how often this process wrote it (only the main process may), recorded at once
real_replace = os.replace


def replace(src, dst, *args, **kwargs):
    result = real_replace(src, dst, *args, **kwargs)
    if Path(dst).name == "status.json":
        state["status_writes"] += 1
        record()
    return result


os.replace = replace

# --- non-finite losses; fp16 with a loss scaler on the CPU
if FAULT in ("inf_loss", "nan_loss"):
    import torch.nn.functional as F

    real_cross_entropy = F.cross_entropy

    def cross_entropy(*args, **kwargs):
        loss = real_cross_entropy(*args, **kwargs)
        if torch.is_grad_enabled() and ACTS and not calls["fired"] and global_step() == AT:
            calls["fired"] = True
            return loss * float("inf" if FAULT == "inf_loss" else "nan")
        return loss

    F.cross_entropy = cross_entropy

if FAULT == "inf_loss":
    accelerator_module = sys.modules["common.accelerator"]  # start_run builds the Accelerator through it
    real_build = accelerator_module.build_accelerator

    def build_fp16_accelerator(**kwargs):
        accelerator = real_build(**kwargs)
        # What accelerate sets up for fp16 on a GPU: a scaler that the optimizer wrapper (made in
        # prepare) steps and updates, and native AMP so clip_grad_norm_ unscales before clipping.
        # A small scale that never grows: only the injected inf overflows, so the expected count is exact.
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**7, growth_interval=10**6)
        accelerator.native_amp = True
        accelerator.state._mixed_precision = "fp16"
        return accelerator

    accelerator_module.build_accelerator = build_fp16_accelerator

if FAULT == "signal_at_exit" and ACTS:
    def signal_during_the_teardown() -> None:
        signal_the_group()
        time.sleep(2)

    loader_iterator = torch.utils.data.dataloader._MultiProcessingDataLoaderIter
    real_shutdown = loader_iterator._shutdown_workers

    def shutdown_workers(self, *args, **kwargs):  # at main()'s end, persistent workers are ended here
        if not calls["fired"]:
            calls["fired"] = True
            signal_during_the_teardown()
        return real_shutdown(self, *args, **kwargs)

    loader_iterator._shutdown_workers = shutdown_workers
    atexit.register(signal_during_the_teardown)  # and again as the interpreter exits

record()
try:
    template.main(argv)
    state["exit_code"] = 0
except SystemExit as stop:
    state["exit_code"] = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    raise
except BaseException as error:  # what it was, for the test's message: an exit 1 is a bug to find
    state["exit_code"], state["error"] = 1, f"{type(error).__name__}: {error}"[-2000:]
    raise
finally:
    record()
