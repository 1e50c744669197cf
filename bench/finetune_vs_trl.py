"""Fine-tuning side by side with TRL: the template against TRL's `SFTTrainer` (its `trl sft` script), padded and packed.

Both run as a user types them, through `accelerate launch -q --config_file accelerate_configs/cpu.yaml`, one
process on the CPU, on the same tiny model (scripts/make_tiny_model.py's, a few layers), the same data (the
mixed-length reverse task of bench/finetune_packing.py, a folder with train.jsonl and validation.jsonl that both
read through `datasets`), the same batch, step count and seed, learning rate 1e-3 with 10 warmup steps and a cosine
decay to 10% of it, AdamW betas (0.9, 0.95) (fused on the CPU in both), no weight decay, gradient clipping at 1.0,
fp32, completion-only loss weighted by token, no activation checkpointing, no tracker. Four arms, alternating
(the order reversed every other round, so load from other users of a shared machine falls on all alike):

  template padded   templates/finetune_causal_lm.py, --batch_size B (each batch padded to its longest example)
  TRL padded        bench/trl_sft.py (TRL's own trl/scripts/sft.py plus a throughput log), same batch
  template packed   --packing true: rows of --max_length tokens holding about B examples a step
  TRL packed        --packing true (TRL's best-fit-decreasing packing, padding-free), the same rows a step
  (--padding-free adds: TRL padding-free, unpacked: each batch of B examples flattened into one row)

Figures, per round: steady non-padding tokens per second (each tool's own count: the template's log, TRL's
`num_tokens`; the first 10 steps, start-up, left out), template / TRL for padded vs padded and packed vs packed;
the whole command's time, TRL s / template s (above 1: the template finished first); and the final validation
loss per completion token of each export, computed here by one evaluator for all (`from_pretrained`, each
validation example alone: harness.completion_loss). Evaluation during training: the template validates before
training and at the end, TRL at the end (`--eval_strategy steps --eval_steps <steps>`); both write their model at
the end (the template also a checkpoint).

TRL is not a dependency of the project: `pip install -r bench/requirements-trl.txt` (the versions measured),
or run the TRL arms with another environment's Python (`--trl-python /work/trl-venv/bin/python`).

    python bench/finetune_vs_trl.py                  # ~5 minutes on 2 busy cores
    python bench/finetune_vs_trl.py --dry-run        # prints the arms' commands, runs nothing (no TRL needed)
    python bench/finetune_vs_trl.py --quick          # a tiny run: checks the script (needs TRL), measures nothing
    python bench/finetune_vs_trl.py --write-results  # also update bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from finetune_packing import template_args  # noqa: E402  (the template's settings: the same in both benches)

LEARNING_RATE, WARMUP, MIN_LR_RATE = "1e-3", "10", "0.1"  # the template's warmup_cosine ends at 10% of the peak


def trl_args(arm: str, model_dir: Path, data_dir: Path, output_dir: Path, args, rows: int) -> list[str]:
    """`trl sft` options for one arm, matching template_args: TRL's defaults that differ from the template's
    (bf16, activation checkpointing, beta2 0.999, lr 2e-5, linear schedule, seed 42) set to the template's."""
    common = ["--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--output_dir",
              str(output_dir), "--max_steps", str(args.steps), "--learning_rate", LEARNING_RATE,
              "--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", f'{{"min_lr_rate": {MIN_LR_RATE}}}',
              "--warmup_steps", WARMUP, "--adam_beta1", "0.9", "--adam_beta2", "0.95", "--weight_decay", "0.0",
              "--max_grad_norm", "1.0", "--bf16", "false", "--gradient_checkpointing", "false", "--seed", "0",
              "--logging_steps", "10", "--save_strategy", "no", "--eval_strategy", "steps", "--eval_steps",
              str(args.steps), "--dataset_test_split", "validation", "--report_to", "none"]
    if arm == "padded":
        return common + ["--per_device_train_batch_size", str(args.batch_size), "--max_length", str(args.max_length)]
    if arm == "packed":
        return common + ["--per_device_train_batch_size", str(rows), "--max_length", str(args.max_length),
                         "--packing", "true"]
    # padding-free without packing: TRL refuses a max_length there (it would not be enforced); none is too long
    return common + ["--per_device_train_batch_size", str(args.batch_size), "--max_length", "None",
                     "--padding_free", "true"]


def launch(python: str, script: str, argv: list[str], threads: int, env: dict) -> tuple[float, str]:
    """`accelerate launch -q --config_file accelerate_configs/cpu.yaml <script> <argv>` with the given Python;
    returns (seconds, combined output). A failure ends the bench with its output."""
    command = [python, "-m", "accelerate.commands.launch", "-q", "--config_file", str(harness.CONFIGS / "cpu.yaml"),
               "--main_process_port", str(harness.free_port()), "--num_cpu_threads_per_process", str(threads),
               str(harness.REPO / script), *argv]
    began = time.perf_counter()
    try:
        done = harness.run_killable(command, cwd=harness.REPO, env=env, timeout=900)
    except subprocess.TimeoutExpired:
        sys.exit(f"{script}: no end after 900 s")
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        sys.exit(f"{script} {' '.join(argv)}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return seconds, done.stdout + done.stderr


def arms(padding_free: bool) -> list[tuple[str, str]]:
    """(tool, batching) in the order of an even round."""
    extra = [("TRL", "padding-free")] if padding_free else []
    return [("template", "padded"), ("TRL", "padded"), ("template", "packed"), ("TRL", "packed"), *extra]


def arm_command(tool: str, batching: str, model_dir: Path, data_dir: Path, output_dir: Path, args,
                rows: int) -> tuple[str, list[str]]:
    if tool == "template":
        return "templates/finetune_causal_lm.py", template_args(batching, model_dir, data_dir, output_dir, args, rows)
    return "bench/trl_sft.py", trl_args(batching, model_dir, data_dir, output_dir, args, rows)


def measure(tool: str, output_dir: Path) -> tuple[float, float, Path]:
    """(steady non-padding tokens/s, tokens a step, the export folder) of a finished run."""
    if tool == "template":
        records = harness.read_metrics(output_dir)
        intervals, steps, export = harness.template_intervals(records), max(r["step"] for r in records), \
            output_dir / "model"
    else:
        records = harness.read_jsonl(output_dir / "throughput.jsonl")
        intervals, steps, export = [(r["tokens"], r["seconds"]) for r in records], records[-1]["step"], output_dir
    return harness.steady_rate(intervals), sum(tokens for tokens, _ in intervals) / steps, export


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all arms, alternating")
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps of each run")
    parser.add_argument("--batch-size", type=int, default=16, help="examples a step, padded (packed: rows holding "
                                                                   "about as many)")
    parser.add_argument("--max-length", type=int, default=128, help="tokens a packed row holds (and the longest "
                                                                    "example allowed)")
    parser.add_argument("--hidden", type=int, default=128, help="the tiny model's width")
    parser.add_argument("--layers", type=int, default=4, help="the tiny model's decoder layers")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each training process")
    parser.add_argument("--padding-free", action="store_true", help="add TRL's padding-free arm (unpacked batches "
                                                                    "flattened into one row)")
    parser.add_argument("--trl-python", default=sys.executable,
                        help="the Python whose environment has TRL (default: this one)")
    parser.add_argument("--dry-run", action="store_true", help="print the arms' commands and stop (no TRL needed)")
    parser.add_argument("--quick", action="store_true", help="one short round on a smaller model: checks the script")
    parser.add_argument("--write-results", action="store_true", help="replace this script's section of RESULTS.md")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.hidden, args.layers = 1, 20, 64, 2
    plan = arms(args.padding_free)
    if args.dry_run:  # the packed rows a step follow from the data; here the default data's count
        for tool, batching in plan:
            script, argv = arm_command(tool, batching, Path("runs/tiny"), Path("runs/mixed"),
                                       Path(f"runs/{tool.lower()}-{batching}"), args, rows=4)
            print(harness.launch_text("cpu.yaml", script, argv))
        return
    check = subprocess.run([args.trl_python, "-c", "import trl; print(trl.__version__)"], capture_output=True,
                           text=True)
    if check.returncode != 0:
        sys.exit(f"error: no TRL in {args.trl_python}: pip install -r bench/requirements-trl.txt (or pass "
                 "--trl-python)")
    harness.set_threads(args.threads)  # this process evaluates; and the machine line reports it
    info = harness.machine() | {"trl": check.stdout.strip()}
    import transformers

    with tempfile.TemporaryDirectory(prefix="finetune_vs_trl_") as tmp:
        tmp = Path(tmp)
        model_dir, data_dir = harness.write_finetune_task(tmp, hidden=args.hidden, layers=args.layers,
                                                          train=400 if args.quick else 2000, val=64)
        rows, per_row = harness.rows_for_examples(model_dir, data_dir, args.batch_size, args.max_length)
        validation = harness.read_jsonl(data_dir / "validation.jsonl")
        env = harness.clean_env(args.threads, HF_DATASETS_CACHE=str(tmp / "datasets-cache"))  # no trace in ~/.cache
        print(f"model: {args.layers} layers x {args.hidden}; packed: {per_row:.1f} examples a row of "
              f"{args.max_length} tokens, {rows} rows a step (padded: {args.batch_size} examples a step); "
              f"TRL {info['trl']}, transformers {transformers.__version__}", flush=True)
        results: dict[tuple[str, str], list[dict]] = {arm: [] for arm in plan}
        for round_ in range(args.rounds):
            for tool, batching in plan if round_ % 2 == 0 else plan[::-1]:
                output_dir = tmp / f"{tool}-{batching}-{round_}"
                script, argv = arm_command(tool, batching, model_dir, data_dir, output_dir, args, rows)
                seconds, _ = launch(sys.executable if tool == "template" else args.trl_python, script, argv,
                                    args.threads, env)
                steady, per_step, export = measure(tool, output_dir)
                loss = harness.completion_loss(export, model_dir, validation)
                results[tool, batching].append({"steady": steady, "seconds": seconds, "per_step": per_step,
                                                "val_loss": loss})
                print(f"round {round_ + 1} {tool} {batching}: {steady:,.0f} tokens/s steady, {per_step:,.0f} "
                      f"tokens a step, {seconds:.1f} s command, final val loss {loss:.4f}", flush=True)
        commands = [harness.launch_text("cpu.yaml", *arm_command(
            tool, batching, Path("runs/tiny"), Path("runs/mixed"), Path(f"runs/{tool.lower()}-{batching}"), args,
            rows)) for tool, batching in plan]
        if args.trl_python != sys.executable:
            commands = [c if "trl_sft.py" not in c else f"# with {args.trl_python}:\n{c}" for c in commands]

    table_rows = []
    for (tool, batching), runs in results.items():
        table_rows.append([f"{tool} {batching}", f"{statistics.median(r['per_step'] for r in runs):,.0f}",
                           f"{statistics.median(r['steady'] for r in runs):,.0f}",
                           f"{statistics.median(r['seconds'] for r in runs):.1f}",
                           " / ".join(f"{r['val_loss']:.4f}" for r in runs)])
    body = harness.table(["arm", "non-padding tokens a step", "steady tokens/s (median)", "whole command s (median)",
                          "final val loss (one evaluator), each round"], table_rows)
    lines = []
    for batching in ("padded", "packed"):
        ours, theirs = results["template", batching], results["TRL", batching]
        steady = [a["steady"] / b["steady"] for a, b in zip(ours, theirs)]
        whole = [b["seconds"] / a["seconds"] for a, b in zip(ours, theirs)]
        losses = [a["val_loss"] - b["val_loss"] for a, b in zip(ours, theirs)]
        lines.append(f"- {batching} vs {batching}: steady non-padding tokens/s template / TRL "
                     f"{harness.spread(steady)}; whole command TRL s / template s {harness.spread(whole)}; "
                     f"final val loss template - TRL {harness.spread(losses)}")
    if args.padding_free:
        ours, theirs = results["template", "packed"], results["TRL", "padding-free"]
        lines.append("- template packed vs TRL padding-free: steady tokens/s template / TRL "
                     f"{harness.spread([a['steady'] / b['steady'] for a, b in zip(ours, theirs)])}")
    verdict = f"{args.rounds} rounds, ratios median [min-max]:\n" + "\n".join(lines)
    print(f"\n{body}\n\n{verdict}")
    if args.write_results and not args.quick:
        setup = (f"TRL {info['trl']}, transformers {transformers.__version__}. Model: scripts/make_tiny_model.py, "
                 f"{args.layers} layers x {args.hidden}; data: the mixed-length reverse task (2,000 training, 64 "
                 f"validation examples); {args.steps} steps; padded batches of {args.batch_size} examples; packed: "
                 f"{per_row:.1f} examples a row of {args.max_length} tokens, {rows} rows a step. The arms' commands "
                 "(the folders are temporary ones in the run):\n\n```bash\n" + "\n".join(commands) + "\n```")
        harness.write_results("finetune_vs_trl", "Fine-tuning: the template vs TRL's SFTTrainer (CPU, 1 process)",
                              f"{setup}\n\n{body}\n\n{verdict}", info)


if __name__ == "__main__":
    main()
