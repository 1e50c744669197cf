"""The fixed costs of a short fine-tuning run, phase by phase: what a 30-step run spends before its first optimizer
step and after its last, on this checkout and (--baseline) on another commit, arms alternating.

Each arm is the fine-tuning template launched as a user types it (`accelerate launch -q --config_file
accelerate_configs/cpu.yaml`, one process), through bench/phases_entry.py, which times the template's own functions
where the template looks them up (`load_model`, `evaluate`, `answer_probes`, the CheckpointManager's `save`, `wait`
and `restore_best`, `export_model`, `sample`, `end_run`, the progress bar's steps); the launch itself and the exit
are timed from here. Data: a chat task of 2-digit additions ("What is 41 + 17? Reply with the number only."), 200
training and 50 validation conversations; the template's defaults otherwise (one evaluation before training and one
at the end with --eval_samples answers, the final checkpoint in the background, the export, a --sample_tokens sample).

    python bench/finetune_phases.py --model /work/smollm2-hf --baseline a381d22   # ~8 minutes on 2 busy cores
    python bench/finetune_phases.py --quick       # a tiny model, a few steps: checks the script, measures nothing
    python bench/finetune_phases.py --model /work/smollm2-hf --baseline a381d22 --write-results
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

ENTRY = Path(__file__).resolve().parent / "phases_entry.py"
# (phase, what it is), in the order a run goes through them
PHASES = [("launcher", "`accelerate launch` until the training process runs its first line"),
          ("imports", "the template's imports (torch, transformers, accelerate, common/)"),
          ("setup", "options, tokenizer and config, data, model, prepare, checkpoint manager"),
          ("evaluation before training", "the pretrained model's validation loss"),
          ("to the first step", "from there to the end of the first optimizer step (one step's compute)"),
          ("training", "the end of the first step to the end of the last (steps 2 to N)"),
          ("evaluation at the end", "the validation loss at the last step"),
          ("sample answers", "greedy answers to --eval_samples validation prompts"),
          ("checkpoint at the step", "the last checkpoint's save call (a copy to host memory, in the background)"),
          ("checkpoint written", "waiting for the background write before the export"),
          ("export", "the best weights restored where they are not the last, save_pretrained, tokenizer"),
          ("sample", "the --sample_tokens greedy sample at the end"),
          ("end", "status.json, trackers, the process group; the training process's exit; the launcher's")]


def addition_task(count: int, rng: random.Random) -> list[dict]:
    records = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        records.append({"messages": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."},
                                     {"role": "assistant", "content": str(a + b)}]})
    return records


def write_task(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for split, count in (("train", 200), ("validation", 50)):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in addition_task(count, rng)))
    return folder


def template_args(model: Path, data: Path, output_dir: Path, args) -> list[str]:
    return ["--model", str(model), "--data_path", str(data), "--output_dir", str(output_dir), "--max_steps",
            str(args.steps), "--batch_size", str(args.batch_size), "--tracker", "none", "--seed", "0"]


def run_arm(repo: Path, argv: list[str], events_file: Path, threads: int, env: dict) -> dict[str, float]:
    """One launch of `repo`'s template; the seconds of each phase."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "-q", "--config_file",
               str(repo / "accelerate_configs" / "cpu.yaml"), "--main_process_port", str(harness.free_port()),
               "--num_cpu_threads_per_process", str(threads), str(ENTRY), str(repo), str(events_file), "--", *argv]
    began = time.time()
    try:
        done = harness.run_killable(command, cwd=repo, env=env, timeout=1800)
    except subprocess.TimeoutExpired:
        sys.exit(f"error: {' '.join(command)} ran past 30 minutes")
    ended = time.time()
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(command)} exited with {done.returncode}:\n{done.stdout[-3000:]}\n"
                 f"{done.stderr[-3000:]}")
    return phases(json.loads(events_file.read_text()), began, ended)


def phases(record: dict, began: float, ended: float) -> dict[str, float]:
    """The seconds of each phase from the entry's events: (name, start, end) of each timed call, wall clock."""
    events = record["events"]

    def calls(name):
        return [(start, end) for what, start, end in events if what == name]

    steps, loop_start = record["steps"], record["loop_start"]
    evals = calls("evaluate")
    before = [e for e in evals if e[1] <= loop_start]
    final_eval = [e for e in evals if e[0] >= steps[-1]][0]
    answers = [e for e in calls("answer_probes") if e[0] >= steps[-1]]
    saves = [e for e in calls("save") if e[0] >= steps[-1]]
    waits = [e for e in calls("wait") if saves and e[0] >= saves[0][1]]
    export, sample, end_run = calls("export_model"), calls("sample"), calls("end_run")
    restore = calls("restore_best")
    out = {"launcher": record["entry"] - began, "imports": record["imported"] - record["entry"]}
    out["evaluation before training"] = sum(e - s for s, e in before)
    out["setup"] = loop_start - record["imported"] - out["evaluation before training"]
    out["to the first step"] = steps[0] - loop_start
    out["training"] = steps[-1] - steps[0]
    out["evaluation at the end"] = final_eval[1] - final_eval[0]
    out["sample answers"] = sum(e - s for s, e in answers)
    out["checkpoint at the step"] = sum(e - s for s, e in saves)
    # the template's own wait before the export (the one that starts last before the export: the others are the
    # save's internal ones, inside its call)
    outside = [w for w in waits if not any(s <= w[0] and w[1] <= e for s, e in saves)]
    out["checkpoint written"] = sum(e - s for s, e in outside)
    out["export"] = sum(e - s for s, e in export) + sum(e - s for s, e in restore
                                                        if not any(s <= r and e <= t for r, t in outside))
    out["sample"] = sum(e - s for s, e in sample)
    out["end"] = ended - end_run[0][0] if end_run else ended - export[-1][1]
    out["start to the first step"] = steps[0] - began
    out["last step to exit"] = ended - steps[-1]
    out["whole command"] = ended - began
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="a local model folder (default: a tiny model made on the spot)")
    parser.add_argument("--baseline", default="", help="a git commit to compare with (its template, common/ "
                                                       "and accelerate_configs/ from `git archive`), arms alternating")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of both arms, alternating")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of each run")
    parser.add_argument("--batch-size", type=int, default=4, help="--batch_size")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of the training process")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 4 steps: checks the script")
    parser.add_argument("--write-results", action="store_true", help="replace this script's section of RESULTS.md")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.model = 4, ""
    info = harness.machine()
    with tempfile.TemporaryDirectory(prefix="finetune_phases_") as tmp:
        tmp = Path(tmp)
        data = write_task(tmp / "data")
        model = Path(args.model) if args.model else None
        if model is None:
            sys.path.insert(0, str(harness.REPO / "scripts"))
            from make_tiny_model import make_tiny_model

            model = make_tiny_model(tmp / "tiny")
        arms = {"this checkout": harness.REPO}
        if args.baseline:
            baseline = tmp / "baseline"  # its template, common/ and launch configs, as `git archive` gives them
            baseline.mkdir()
            archive = subprocess.run(["git", "archive", args.baseline, "templates", "common", "accelerate_configs"],
                                     cwd=harness.REPO, check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(baseline)], input=archive, check=True)
            arms = {f"before ({args.baseline})": baseline, **arms}
        env = harness.clean_env(args.threads, HF_DATASETS_CACHE=str(tmp / "datasets-cache"))
        results: dict[str, list[dict]] = {arm: [] for arm in arms}
        for round_ in range(args.rounds):
            for arm in list(arms) if round_ % 2 == 0 else list(arms)[::-1]:
                out = tmp / f"run-{len(results[arm])}-{arm.split()[0]}"
                results[arm].append(run_arm(arms[arm], template_args(model, data, out, args),
                                            tmp / f"{out.name}.json", args.threads, env))
                print(f"round {round_ + 1} {arm}: {results[arm][-1]['whole command']:.1f} s", flush=True)
        command = harness.launch_text("cpu.yaml", "templates/finetune_causal_lm.py",
                                      template_args(Path(args.model or "runs/tiny"), Path("runs/additions"),
                                                    Path("runs/phases"), args))

    names = [name for name, _ in PHASES] + ["start to the first step", "last step to exit", "whole command"]
    rows = []
    for name in names:
        cells = [" / ".join(f"{r[name]:.1f}" for r in results[arm]) for arm in results]
        if len(results) == 2:
            first, second = results.values()
            cells.append(f"{statistics.median(b[name] - a[name] for a, b in zip(first, second)):+.1f}")
        described = dict(PHASES).get(name, "")
        rows.append([f"**{name}**" if not described else name, *cells, described])
    headers = ["phase", *(f"{arm}, s" for arm in results), *(["change, s (median)"] if len(results) == 2 else []),
               "what it is"]
    body = harness.table(headers, rows)
    print(f"\n{body}")
    if args.write_results and not args.quick:
        setup = (f"Model {args.model}; the 2-digit additions chat task (200 training, 50 validation conversations); "
                 f"{args.steps} steps of batch {args.batch_size}, one process, {args.threads} threads, fp32, the "
                 f"template's defaults otherwise; {args.rounds} round(s), arms alternating, each figure per round. "
                 "The template's command (bench/phases_entry.py runs the same with timing):\n\n"
                 f"```bash\n{command}\n```")
        harness.write_results("finetune_phases", "Fine-tuning: the fixed costs of a short run, phase by phase (CPU)",
                              f"{setup}\n\n{body}", info)


if __name__ == "__main__":
    main()
