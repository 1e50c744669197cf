"""Finish many short 2-rank runs and count the ones that did not exit cleanly.

    python scripts/stress_finish.py              # 40 runs, round-robin over the four cells below
    python scripts/stress_finish.py --runs 4     # one run per cell (what tests/test_stress_finish.py does)

Each run is a real `accelerate launch` of a template with tiny settings on 2 CPU ranks (gloo), in a
fresh output folder, over every cell of {image, language model} x {cpu_ddp.yaml, fsdp.yaml}. A run
counts as failed when `accelerate launch` exits non-zero; an abort is a failed run whose output shows
a rank killed by SIGABRT (`exitcode: -6`, "terminate called ..."), the symptom this script was
written to measure (README, "Errors and exit codes"). The ranks run with PYTHONFAULTHANDLER=1, so an
abort prints every thread's Python stack. Prints one row per cell and exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from search.sweep import free_port  # noqa: E402  (the one copy; search/ imports no torch)

IMAGE_ARGS = ("--epochs", "1", "--width", "8", "--depth", "1", "--num_workers", "0", "--tracker", "none")
LM_ARGS = ("--max_steps", "20", "--eval_every_steps", "10", "--eval_batches", "2", "--n_layer", "1", "--n_head", "2",
           "--n_embd", "32", "--block_size", "32", "--batch_size", "8", "--sample_tokens", "0", "--tracker", "none")
CELLS = (("image", "cpu_ddp.yaml"), ("image", "fsdp.yaml"), ("language model", "cpu_ddp.yaml"),
         ("language model", "fsdp.yaml"))
ABORT_MARKERS = ("exitcode  : -6", "exitcode: -6", "terminate called", "SIGABRT")


@dataclass
class Result:
    index: int
    template: str
    config: str
    returncode: int
    seconds: float
    output: str

    @property
    def aborted(self) -> bool:
        return self.returncode != 0 and any(marker in self.output for marker in ABORT_MARKERS)


def clean_env() -> dict[str, str]:
    """As tests/conftest.py: offline, one thread per rank, no accelerate or rank settings leaking in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "ACCELERATE_", "FSDP_"))}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONFAULTHANDLER": "1"})
    return env


def tiny_corpus(path: Path) -> Path:
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "cat", "runs", "far", "away"]
    path.write_text("".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) + "\n" for _ in range(380)))
    return path


def run_one(index: int, template: str, config: str, root: Path, corpus: Path, timeout: float) -> Result:
    out = root / f"run{index:03d}"
    if template == "image":
        script, args = REPO / "templates" / "image_classification.py", IMAGE_ARGS
    else:
        script, args = REPO / "templates" / "language_model.py", ("--data_path", str(corpus), *LM_ARGS)
    config_file = REPO / "accelerate_configs" / config
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
               "--main_process_port", str(free_port()), "--num_processes", "2",
               str(script), "--output_dir", str(out), *args]
    started = time.monotonic()
    try:
        done = subprocess.run(command, check=False, cwd=REPO, env=clean_env(), capture_output=True, text=True,
                              timeout=timeout)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as error:
        returncode = -1
        output = f"timed out after {timeout:g} s\n{error.stdout or ''}{error.stderr or ''}"
    return Result(index, template, config, returncode, time.monotonic() - started, output)


def summarize(results: list[Result], wall: float) -> str:
    lines = [f"{'template':<16}{'config':<14}{'runs':>6}{'failed':>8}{'aborts':>8}{'mean s':>8}"]
    for template, config in CELLS:
        cell = [r for r in results if (r.template, r.config) == (template, config)]
        if not cell:
            continue
        failed = sum(r.returncode != 0 for r in cell)
        aborts = sum(r.aborted for r in cell)
        mean = sum(r.seconds for r in cell) / len(cell)
        lines.append(f"{template:<16}{config:<14}{len(cell):>6}{failed:>8}{aborts:>8}{mean:>8.1f}")
    failed = sum(r.returncode != 0 for r in results)
    aborts = sum(r.aborted for r in results)
    lines.append(f"{'all':<30}{len(results):>6}{failed:>8}{aborts:>8}    wall {wall:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="finished runs to launch, round-robin over the cells")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each is 2 ranks)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before one run counts as hung")
    parser.add_argument("--show", type=int, default=3, help="print the output tail of this many failed runs")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.jobs < 1:
        parser.error("--runs and --jobs must be at least 1")

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stress_finish_") as tmp:
        root = Path(tmp)
        corpus = tiny_corpus(root / "tiny.txt")
        plan = [(i, *CELLS[i % len(CELLS)]) for i in range(args.runs)]
        results: list[Result] = []
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(run_one, i, template, config, root, corpus, args.timeout)
                       for i, template, config in plan]
            for future in futures:
                result = future.result()
                results.append(result)
                status = "ok" if result.returncode == 0 else "ABORT" if result.aborted else f"exit {result.returncode}"
                print(f"run {result.index + 1:>3}/{args.runs}  {result.template:<15}{result.config:<13}"
                      f"{result.seconds:5.1f} s  {status}", flush=True)
    failures = [r for r in results if r.returncode != 0]
    for result in failures[:args.show]:
        print(f"\n--- run {result.index + 1} ({result.template}, {result.config}), exit {result.returncode}: "
              f"last lines ---\n" + "\n".join(result.output.splitlines()[-40:]))
    print("\n" + summarize(results, time.monotonic() - started))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
