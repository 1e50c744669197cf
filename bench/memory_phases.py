"""Host memory of a fine-tuning run over time, per phase: where the peak is.

The fine-tuning template runs as a user types it (`accelerate launch -q --config_file accelerate_configs/cpu.yaml`,
one process on the CPU), through an entry (this file with `--entry`) that calls the template's own `main()` and
marks when each phase starts: start-up, data, model load, the evaluation before training, training steps,
evaluation, sample answers, checkpoint writes, export, the sample at the end, teardown. This process samples the
resident memory (RSS) of the whole process tree every `--interval-ms` (the `accelerate launch` parent, the training
process and any loader workers, summed) and reports, per phase, its duration and the highest RSS seen in it.

The default run is the one issue 32 measured against TRL 1.16 (peak 2,887 / 2,918 MiB for `SFTTrainer`): a real
pretrained model (`--model`: a plain Hugging Face folder; SmolLM2-135M-Instruct, fp32), full fine-tuning, batch 4,
30 steps, on a chat task of two-digit additions made here (200 training, 50 validation examples), template
defaults otherwise (4 sample answers at the evaluation, a 32-token sample at the end, the checkpoint in the
background), no tracker.

    python bench/memory_phases.py --model /work/smollm2-hf                  # ~2 minutes on 2 quiet cores
    python bench/memory_phases.py --model /work/smollm2-hf --lora-r 16      # LoRA
    python bench/memory_phases.py --quick                                   # tiny model: checks the script
    python bench/memory_phases.py --model /work/smollm2-hf --write-results  # also update bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

MIB = 2 ** 20


# ------------------------------------------------------------------------------- the launched entry
def entry(marks_path: Path, template_args: list[str]) -> None:
    """In the training process: the template's main(), each phase's start appended to `marks_path` as it begins
    (time.monotonic, the clock this process's sampler reads too)."""
    marks = open(marks_path, "a")
    stack: list[str] = []

    def mark(phase: str) -> None:
        marks.write(json.dumps([time.monotonic(), phase]) + "\n")
        marks.flush()

    def phased(name: str, function, label=None):
        def wrapper(*args, **kwargs):
            phase = label() if label else name
            stack.append(phase)
            mark(phase)
            try:
                return function(*args, **kwargs)
            finally:
                stack.pop()
                mark(stack[-1] if stack else f"after {phase}")
        return wrapper

    mark("start-up (imports)")
    module = harness.load_template("finetune_causal_lm")
    evaluations = {"count": 0}

    def evaluation_label() -> str:
        evaluations["count"] += 1
        return "evaluation before training" if evaluations["count"] == 1 else "evaluation"

    for name, label in (("load_tokenizer_and_config", "start-up (tokenizer, data)"), ("load_model", "model load"),
                        ("evaluate", evaluation_label), ("answer_probes", "sample answers"),
                        ("export_model", "export"), ("sample", "sample at the end"), ("end_run", "teardown")):
        setattr(module, name, phased(label if isinstance(label, str) else name, getattr(module, name),
                                     None if isinstance(label, str) else label))
    manager = module.CheckpointManager
    for method, label in (("resume", "checkpoint resume"), ("save", "checkpoint save (at the step)"),
                          ("wait", "checkpoint wait (write)"), ("restore_best", "checkpoint restore best")):
        setattr(manager, method, phased(label, getattr(manager, method)))
    progress_bar = module.progress_bar

    def marked_bar(*args, **kwargs):
        mark("before the first step")
        bar = progress_bar(*args, **kwargs)
        update = bar.update

        def first_update(n=1):
            mark("training steps")
            bar.update = update
            return update(n)

        bar.update = first_update
        return bar

    module.progress_bar = marked_bar
    try:
        module.main(template_args)
    finally:
        mark("exit")
        marks.close()


# --------------------------------------------------------------------------------- the sampler
def tree_memory(root, processes: list) -> tuple[int, int, dict[str, int]]:
    """(RSS, PSS) of `root` and all its descendants summed (bytes), and RSS per process. RSS is what issue 32 compared
    with TRL; PSS splits pages shared between processes (a fork's copy-on-write pages, mapped files) among them, so
    a short-lived fork does not count its parent's memory twice."""
    import psutil

    rss_total, pss_total, parts = 0, 0, {}
    for process in processes:
        try:
            rollup = dict(line.split(":", 1) for line in
                          Path(f"/proc/{process.pid}/smaps_rollup").read_text().splitlines()[1:])
            rss, pss = (int(rollup[key].split()[0]) * 1024 for key in ("Rss", "Pss"))
            kind = "launcher" if process.pid == root.pid else "training process"
            if process.pid != root.pid and process.ppid() != root.pid:
                kind = f"child {' '.join(process.cmdline()[:3])[:60]}"
        except (psutil.Error, OSError, KeyError, ValueError):  # ended between the listing and the read
            continue
        rss_total, pss_total = rss_total + rss, pss_total + pss
        parts[kind] = parts.get(kind, 0) + rss
    return rss_total, pss_total, parts


def run(model: str, data_dir: Path, output_dir: Path, args, marks_path: Path) -> dict:
    """Launch one run, sampling its tree's RSS; returns samples, marks and the command's exit."""
    import subprocess

    import psutil

    template_args = ["--model", model, "--data_path", str(data_dir), "--output_dir", str(output_dir),
                     "--max_steps", str(args.steps), "--batch_size", str(args.batch_size), "--tracker", "none",
                     "--learning_rate", "2e-4" if args.lora_r else "2e-5", *(
                         ["--lora_r", str(args.lora_r)] if args.lora_r else []), *args.extra]
    command = [sys.executable, "-m", "accelerate.commands.launch", "-q", "--config_file",
               str(harness.CONFIGS / "cpu.yaml"), "--main_process_port", str(harness.free_port()),
               "--num_cpu_threads_per_process", str(args.threads), str(Path(__file__).resolve()), "--entry",
               str(marks_path), "--", *template_args]
    samples: list[tuple[float, int, int, dict]] = []
    began = time.monotonic()
    with subprocess.Popen(command, cwd=harness.REPO, env=harness.clean_env(args.threads), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True) as process:
        root = psutil.Process(process.pid)
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.extend(process.stdout), daemon=True)
        reader.start()
        processes, listed = [root], 0.0
        while process.poll() is None:
            if time.monotonic() - listed > 0.5:  # listing the tree reads every process on the machine: not each time
                with contextlib.suppress(psutil.Error):
                    processes, listed = [root, *root.children(recursive=True)], time.monotonic()
            samples.append((time.monotonic(), *tree_memory(root, processes)))
            time.sleep(args.interval_ms / 1000)
        reader.join(timeout=10)
    seconds = time.monotonic() - began
    if process.returncode != 0:
        sys.exit(f"the run failed (exit {process.returncode}):\n{''.join(output)[-4000:]}")
    marks = [tuple(json.loads(line)) for line in marks_path.read_text().splitlines()]
    return {"samples": samples, "marks": marks, "seconds": seconds, "began": began,
            "command": harness.launch_text("cpu.yaml", "templates/finetune_causal_lm.py", template_args)}


def phases(result: dict) -> list[dict]:
    """Per phase (in order of first appearance): total seconds and the highest tree RSS sampled in it."""
    marks, out = result["marks"], {}
    bounds = [(t, phase) for t, phase in marks] + [(float("inf"), "exit")]
    for t, total, pss, parts in result["samples"]:
        phase = "launcher start-up"
        for (start, name), (end, _) in zip(bounds, bounds[1:]):
            if start <= t < end:
                phase = name
                break
        else:
            if bounds and t >= bounds[-2][0]:
                phase = "exit"
        row = out.setdefault(phase, {"phase": phase, "seconds": 0.0, "peak": 0, "pss": 0, "parts": {}, "first": t})
        row["pss"] = max(row["pss"], pss)
        if total > row["peak"]:
            row["peak"], row["parts"] = total, parts
    for start, name in marks:  # a phase shorter than the 50 ms between samples: the tree's memory as it began
        before = [sample for sample in result["samples"] if sample[0] <= start] or result["samples"][:1]
        if name not in out and before:
            _, total, pss, parts = before[-1]
            out[name] = {"phase": name, "seconds": 0.0, "peak": total, "pss": pss, "parts": parts, "first": start}
    for (start, name), (end, _) in zip(bounds, bounds[1:]):  # durations from the marks
        row = out.get(name)
        if row is not None and end != float("inf"):
            row["seconds"] += end - start
    if "launcher start-up" in out and marks:
        out["launcher start-up"]["seconds"] = marks[0][0] - result["began"]
    return sorted(out.values(), key=lambda row: row["first"])


def addition_task(folder: Path, train: int, val: int, seed: int = 0) -> Path:
    """A chat task of two-digit additions ("What is A + B? Reply with the number only."), train.jsonl and
    validation.jsonl in `folder`."""
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(10, 100) for b in range(10, 100)], train + val)
    folder.mkdir(parents=True, exist_ok=True)
    for name, chunk in (("train", pairs[:train]), ("validation", pairs[train:])):
        lines = [json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number "
                                                                      "only."},
                                          {"role": "assistant", "content": str(a + b)}]}) for a, b in chunk]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def main() -> None:
    if "--entry" in sys.argv:
        split = sys.argv.index("--")
        entry(Path(sys.argv[sys.argv.index("--entry") + 1]), sys.argv[split + 1:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="a Hugging Face model folder (default: a tiny random model, "
                                                    "made here)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=4, help="examples a step")
    parser.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of the training process")
    parser.add_argument("--interval-ms", type=float, default=50, help="RSS sampling interval")
    parser.add_argument("--label", default="", help="a name for this run in RESULTS.md (e.g. before / after)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and 5 steps: checks the script")
    parser.add_argument("--write-results", action="store_true", help="add this run to its section of RESULTS.md")
    parser.add_argument("extra", nargs="*", help="more template options, after --")
    args = parser.parse_args()
    if args.quick:
        args.steps = 5
    info = harness.machine()
    with tempfile.TemporaryDirectory(prefix="memory_phases_") as tmp:
        tmp = Path(tmp)
        data_dir = addition_task(tmp / "data", 200, 50)
        model = args.model
        if not model:
            model = str(harness.write_finetune_task(tmp / "tiny", hidden=64, layers=2, train=1, val=1)[0])
        result = run(model, data_dir, tmp / "run", args, tmp / "marks.jsonl")
    rows = phases(result)
    peak = max(rows, key=lambda row: row["peak"])
    pss_peak = max(rows, key=lambda row: row["pss"])
    table_rows = [[row["phase"], f"{row['seconds']:.1f}", f"{row['peak'] / MIB:,.0f}", f"{row['pss'] / MIB:,.0f}",
                   ", ".join(f"{kind} {rss / MIB:,.0f}" for kind, rss in sorted(row["parts"].items()))]
                  for row in rows]
    body = harness.table(["phase", "s", "peak RSS of the process tree, MiB", "peak PSS, MiB",
                          "at the RSS peak, by process (MiB)"],
                         table_rows)
    verdict = (f"peak RSS {peak['peak'] / MIB:,.0f} MiB in '{peak['phase']}', peak PSS "
               f"{pss_peak['pss'] / MIB:,.0f} MiB in '{pss_peak['phase']}'; whole command {result['seconds']:.1f} s; "
               f"{len(result['samples'])} samples")
    print(f"{result['command']}\n\n{body}\n\n{verdict}")
    if args.write_results and not args.quick:
        key = f"memory_phases{'-' + args.label if args.label else ''}"
        setup = (f"{args.label + ': ' if args.label else ''}{args.model}, "
                 f"{'LoRA r=' + str(args.lora_r) if args.lora_r else 'full fine-tuning'}, batch {args.batch_size}, "
                 f"{args.steps} steps, the two-digit addition chat task (200/50), RSS sampled every "
                 f"{args.interval_ms:.0f} ms. The run:\n\n```bash\n{result['command']}\n```")
        harness.write_results(key, f"Fine-tuning memory per phase{' (' + args.label + ')' if args.label else ''}",
                              f"{setup}\n\n{body}\n\n{verdict}", info)


if __name__ == "__main__":
    main()
