"""Send a signal at a random moment of a real run, many times, and check that each run ends as documented.

    python scripts/stress_signals.py --trials 100              # the figure in bench/RESULTS.md and README
    python scripts/stress_signals.py --trials 2 --cells lm-1   # what tests/test_stress_signals.py samples

A trial is a tiny `accelerate launch -q` run of a template in a session of its own (a terminal's process group),
on one cell: the language model on 1 process, 2 DDP ranks or 2 FSDP2 ranks (W&B offline on), the image classifier
on 1 process or 2 DDP ranks, the fine-tuning template (scripts/make_tiny_model.py's model, W&B offline on) on 1
process (full fine-tuning) or 2 DDP ranks (LoRA). One signal comes at a moment drawn uniformly over the run's
whole life, from its launch to 10% past the end of an uninterrupted run of the same cell (measured first) for half
the trials, and from the run's start (its status.json written) to the same end for the other half, so start-up,
loader start, training, evaluation, checkpoint writes, the export and the end are all hit: SIGTERM or SIGINT to the
launcher alone or to the whole process group, SIGUSR1 to rank 0, SIGKILL to rank 0 or 1, or SIGKILL to the launcher
(its ranks then stop as at a preemption). A trial holds when
- no process of the run is left 15 s after the launcher exits;
- the launcher's exit code is one the README gives for it (0, 1, 130, 143; killed by the SIGINT or SIGTERM itself,
  -2 or -15, which a shell reports as 130 or 143; -9 for its SIGKILL; before the run starts, while the launcher or a
  rank imports, a KeyboardInterrupt traceback, as any Python program: counted apart);
- status.json is absent (the signal came before the run started) or says how it ended: finished, stopped,
  preempted, failed with 130 (Ctrl-C) or 5 (a lost rank); `running` only when a rank was SIGKILLed (a crash);
- no Python traceback and no C++ abort ("terminate called") in the output;
- W&B's offline run holds every step of metrics.jsonl (where the run ended by itself, not by SIGKILL);
- `--resume auto` then ends the run bit-identical (every tensor of model.safetensors) to the uninterrupted run.
Prints one line a trial, one row per cell and signal, and exits 1 if any trial did not hold.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from helpers import wandb_history_steps, write_tiny_corpus  # noqa: E402  (tests/helpers.py: stdlib and numpy only)
from search.sweep import free_port  # noqa: E402

LM_ARGS = ("--max_steps", "24", "--eval_every_steps", "8", "--eval_batches", "2", "--n_layer", "1", "--n_head", "2",
           "--n_embd", "32", "--block_size", "32", "--batch_size", "8", "--sample_tokens", "8", "--num_workers", "1",
           "--checkpoint_every_steps", "5", "--log_every_steps", "1", "--dropout", "0.1", "--tracker", "wandb")
IMAGE_ARGS = ("--epochs", "1", "--width", "8", "--depth", "1", "--batch_size", "128", "--num_workers", "1",
              "--checkpoint_every_steps", "3", "--log_every_steps", "1", "--tracker", "none")
FT_ARGS = ("--max_steps", "12", "--eval_every_steps", "4", "--batch_size", "8", "--eval_samples", "2",
           "--sample_tokens", "8", "--num_workers", "1", "--log_every_steps", "1", "--tracker", "wandb")
CELLS = {"lm-1": ("lm", "cpu.yaml", 1), "lm-ddp": ("lm", "cpu_ddp.yaml", 2), "lm-fsdp": ("lm", "fsdp.yaml", 2),
         "image-1": ("image", "cpu.yaml", 1), "image-ddp": ("image", "cpu_ddp.yaml", 2),
         "ft-1": ("ft", "cpu.yaml", 1), "ft-ddp": ("ft-lora", "cpu_ddp.yaml", 2)}
SCRIPTS = {"lm": "language_model.py", "image": "image_classification.py", "ft": "finetune_causal_lm.py",
           "ft-lora": "finetune_causal_lm.py"}
SIGNALS = ("TERM launcher", "INT launcher", "TERM group", "INT group", "USR1 rank0", "KILL rank0", "KILL rank1",
           "KILL launcher")
LAUNCHER_CODES = {0, 1, 130, 143}
END_STATES = {"finished", "stopped", "preempted"}
ABORT = ("Traceback (most recent call last)", "terminate called")


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "ACCELERATE_", "FSDP_"))}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env | {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                  "CURVES_PNG": "0"}


def command(cell: str, output: Path, corpus: Path, resume: bool = False) -> list[str]:
    """The cell's launch; `corpus` is the language model's text, beside it the fine-tuning model and data."""
    template, config, processes = CELLS[cell]
    script = REPO / "templates" / SCRIPTS[template]
    args = {"lm": (*LM_ARGS, "--data_path", str(corpus)), "image": IMAGE_ARGS}.get(template) or (
        *FT_ARGS, "--model", str(corpus.parent / "tiny_model"), "--data_path", str(corpus.parent / "reverse.jsonl"),
        *(("--lora_r", "4") if template == "ft-lora" else ()))
    config_file = REPO / "accelerate_configs" / config
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file), "-q",
            "--main_process_port", str(free_port()), "--num_processes", str(processes), str(script), *args,
            "--output_dir", str(output), *(("--resume", "auto") if resume else ())]


def processes_of(marker: str) -> list[int]:
    """Live processes whose command line holds `marker` (the run's output folder: ranks and their loader workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes() and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def send(what: str, launcher: int, marker: str) -> str:
    name, target = what.split()
    signum = getattr(signal, "SIG" + name)
    if target == "launcher":
        os.kill(launcher, signum)
        return "sent"
    if target == "group":
        os.killpg(launcher, signum)
        return "sent"
    pid = training_processes(launcher, marker).get(int(target[-1]))
    if pid is None:
        return "no such rank yet"
    os.kill(pid, signum)
    return "sent"


def training_processes(launcher: int, marker: str) -> dict[int, int]:
    """rank -> pid: the processes holding `marker` whose parent is not such a process (loader workers are)."""
    pids = set(processes_of(marker)) - {launcher}
    found = {}
    for pid in pids:
        try:
            parent = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        rank = next((int(item[5:]) for item in environ if item.startswith(b"RANK=")), 0)
        if parent not in pids:
            found[rank] = pid
    return found


def model_tensors(output: Path) -> dict:
    """The exported weights of a run folder: model.safetensors, or the fine-tuning template's export in model/ (the
    whole model or the LoRA adapter)."""
    from safetensors.torch import load_file

    for path in (output / "model.safetensors", output / "model" / "model.safetensors",
                 output / "model" / "adapter_model.safetensors"):
        if path.is_file():
            return load_file(path)
    return {}


@dataclass
class Trial:
    index: int
    cell: str
    what: str
    at: float
    into_the_run: bool = False  # `at` counts from the run's start (its status.json), not from the launch
    sent: str = ""
    code: int | None = None
    state: str = "none"
    problems: list[str] = field(default_factory=list)


def run_trial(trial: Trial, root: Path, corpus: Path, baseline: dict) -> Trial:
    output = root / f"trial{trial.index:04d}"
    launcher = subprocess.Popen(command(trial.cell, output, corpus), cwd=REPO, env=clean_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    while trial.into_the_run and not (output / "status.json").is_file() and launcher.poll() is None:
        time.sleep(0.01)  # the moment counts from the run's start (status.json written), not the launch
    deadline = time.monotonic() + trial.at
    while time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.01)
    trial.sent = send(trial.what, launcher.pid, str(output)) if launcher.poll() is None else "after the end"
    try:
        text, _ = launcher.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        for pid in [launcher.pid, *processes_of(str(output))]:
            os.kill(pid, signal.SIGKILL)
        text, _ = launcher.communicate()
        trial.problems.append("hung 240 s")
    trial.code = launcher.returncode
    left_by = time.monotonic() + 15
    while (left := processes_of(str(output))) and time.monotonic() < left_by:
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
        trial.problems.append(f"process {pid} left")
    record = json.loads((output / "status.json").read_text()) if (output / "status.json").is_file() else None
    # Before the run starts (the launcher or a rank still importing) Python ends as any program does on a signal:
    # a KeyboardInterrupt traceback for SIGINT, death by SIGTERM. Counted apart ("before the start"), not failed.
    before_start = record is None and trial.sent == "sent"
    # died of the signal itself (after its handler was gone: its child had ended): a shell says 128 + n, 143 or 130
    if trial.code not in LAUNCHER_CODES and trial.code not in (-2, -15) and not (trial.what == "KILL launcher"
                                                                                and trial.code == -9):
        trial.problems.append(f"launcher exit {trial.code}")
    if before_start and "KeyboardInterrupt" in text:
        text = ""
    killed = trial.what.startswith("KILL rank") and trial.sent == "sent"  # (a launcher's ranks stop as preempted)
    if record is not None:
        trial.state = record["state"] if record["state"] != "failed" else f"failed {record.get('exit_code')}"
        if not (record["state"] in END_STATES or (record["state"] == "failed" and record.get("exit_code") in (130, 5))
                or (record["state"] == "running" and killed)):
            trial.problems.append(f"status {record}")
    for marker in ABORT:
        if marker in text:
            trial.problems.append(f"output has {marker!r}: {text[text.index(marker):][:300]!r}")
    if record is not None and not killed and (output / "wandb").is_dir() and (output / "metrics.jsonl").is_file():
        logged = {json.loads(line)["step"] for line in (output / "metrics.jsonl").read_text().splitlines()}
        missing = logged - set(wandb_history_steps(output))
        if missing:
            trial.problems.append(f"W&B misses steps {sorted(missing)[:5]} of {len(logged)}")
    if baseline is not None:
        done = subprocess.run(command(trial.cell, output, corpus, resume=True), cwd=REPO, env=clean_env(),
                              capture_output=True, text=True, timeout=300)
        final = model_tensors(output)
        if done.returncode != 0 or final.keys() != baseline.keys() or \
                any(not final[key].equal(baseline[key]) for key in baseline):
            trial.problems.append(f"resume: exit {done.returncode}, not bit-identical to the uninterrupted run "
                                  f"({done.stderr.strip().splitlines()[-1:] if done.stderr.strip() else ''})")
    return trial


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, of {', '.join(CELLS)}")
    parser.add_argument("--signals", default=",".join(s.replace(" ", ":") for s in SIGNALS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no_resume", action="store_true", help="skip the resume check (about half the time)")
    args = parser.parse_args(argv)
    cells = args.cells.split(",")
    kinds = [s.replace(":", " ") for s in args.signals.split(",")]
    if not set(cells) <= set(CELLS) or not set(kinds) <= set(SIGNALS) or args.trials < 1:
        parser.error(f"--cells of {', '.join(CELLS)}; --signals of {', '.join(SIGNALS)}; --trials at least 1")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="stress_signals_") as tmp:
        root = Path(tmp)
        corpus = write_tiny_corpus(root / "tiny.txt")
        if any(CELLS[cell][0].startswith("ft") for cell in cells):
            sys.path.insert(0, str(REPO / "scripts"))
            from make_tiny_model import make_tiny_model, reverse_task

            make_tiny_model(root / "tiny_model")
            (root / "reverse.jsonl").write_text("".join(json.dumps(e) + "\n" for e in reverse_task(300)))
        baselines, seconds, start_up = {}, {}, {}
        for cell in cells:  # an uninterrupted run of each cell: its length, and the model a resume must match
            started, output = time.monotonic(), root / f"baseline-{cell}"
            done = subprocess.Popen(command(cell, output, corpus), cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            while not (output / "status.json").is_file() and done.poll() is None:
                time.sleep(0.01)
            start_up[cell] = time.monotonic() - started
            text, _ = done.communicate(timeout=300)
            seconds[cell] = time.monotonic() - started
            if done.returncode != 0:
                print(f"the uninterrupted {cell} run failed:\n{text[-3000:]}")
                return 1
            baselines[cell] = model_tensors(root / f"baseline-{cell}")
            if not baselines[cell]:
                print(f"the uninterrupted {cell} run exported no weights")
                return 1
            print(f"baseline {cell}: {seconds[cell]:.1f} s, {start_up[cell]:.1f} s of it before the run started",
                  flush=True)
        trials = []
        for index in range(args.trials):
            cell = cells[index % len(cells)]
            # half the moments over the whole life from the launch; half over the run itself (start-up, imports
            # above all, takes much of a tiny run's life on a busy machine)
            into_the_run = rng.random() < 0.5
            span = seconds[cell] - start_up[cell] if into_the_run else seconds[cell]
            trial = Trial(index, cell, rng.choice(kinds), round(rng.uniform(0, 1.1 * span), 2), into_the_run)
            if cell.endswith("-1") and trial.what == "KILL rank1":
                trial.what = "KILL rank0"
            run_trial(trial, root, corpus, None if args.no_resume else baselines[cell])
            trials.append(trial)
            print(f"trial {index + 1:>4}/{args.trials} {cell:<10}{trial.what:<14} at {trial.at:5.2f} s "
                  f"{'into the run' if trial.into_the_run else 'from launch'} ({trial.sent}): "
                  f"launcher {trial.code}, {trial.state}" + (f"  FAILED: {'; '.join(trial.problems)}"
                                                              if trial.problems else "  held"), flush=True)
    print(f"\n{'cell':<10}{'signal':<15}{'tried':>6}{'held':>6}{'pre-start':>11}")
    for cell in cells:
        for what in kinds:
            group = [t for t in trials if (t.cell, t.what) == (cell, what)]
            if group:
                print(f"{cell:<10}{what:<15}{len(group):>6}{sum(not t.problems for t in group):>6}"
                      f"{sum(t.state == 'none' for t in group):>11}")
    held = sum(not t.problems for t in trials)
    print(f"{'all':<25}{len(trials):>6}{held:>6}{sum(t.state == 'none' for t in trials):>11}")
    return 0 if held == len(trials) else 1


if __name__ == "__main__":
    sys.exit(main())
