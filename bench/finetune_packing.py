"""Fine-tuning: trained tokens per second, padded batches vs `--packing true`, on data of mixed lengths.

The fine-tuning template runs as a user types it (`accelerate launch -q --config_file
accelerate_configs/cpu.yaml templates/finetune_causal_lm.py ...`), one process on the CPU, on
scripts/make_tiny_model.py's model (a few layers) and a reverse-a-word task whose completions repeat
the answer 1 to 12 times (10-59 tokens an example): a padded batch is padded to its longest example,
so much of its compute goes to padding. Two arms, the same settings but for how batches are made:

  padded   --batch_size B examples a step, each batch padded to its longest
  packed   --packing true: whole examples packed into rows of --max_length tokens, as many rows a step
           as hold about B examples (so both arms train on about the same examples and tokens a step,
           with the same learning-rate schedule and step count, and their losses can be compared)

The arms alternate (padded first in even rounds, packed first in odd ones), so load from other users
of a shared machine falls on both alike. Per round the ratio packed / padded of:
  steady tokens/s  non-padding tokens trained per second, from the template's own log (its Throughput:
                   tokens counted without padding, evaluation left out), the first log interval (start-up)
                   left out
  whole command    the time of the whole `accelerate launch` command, start-up to export
and each run's final validation loss (the template's, per completion token, never packed): packing must
not change what is learned, so the losses should be close (the arms draw different batches).

    python bench/finetune_packing.py                  # ~3-4 minutes on 2 busy cores
    python bench/finetune_packing.py --quick          # a tiny run: checks the script, measures nothing
    python bench/finetune_packing.py --write-results  # also update bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

ARMS = ("padded", "packed")


def template_args(arm: str, model_dir: Path, data_dir: Path, output_dir: Path, args, rows: int) -> list[str]:
    """The template's options for one arm: the same in both but for how a step's examples are batched."""
    common = ["--model", str(model_dir), "--data_path", str(data_dir), "--output_dir", str(output_dir),
              "--max_steps", str(args.steps), "--max_length", str(args.max_length), "--learning_rate", "1e-3",
              "--warmup_steps", "10", "--eval_every_steps", "0", "--sample_tokens", "0", "--tracker", "none",
              "--seed", "0"]
    return common + (["--batch_size", str(args.batch_size)] if arm == "padded" else
                     ["--batch_size", str(rows), "--packing", "true"])


def run_arm(arm: str, argv: list[str], output_dir: Path, threads: int, env: dict) -> dict:
    began = time.perf_counter()
    done, _ = harness.launch("cpu.yaml", "finetune_causal_lm", argv, probe_prefix=None, threads=threads, env=env)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        sys.exit(f"{arm}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    records = harness.read_metrics(output_dir)
    intervals = harness.template_intervals(records)
    steps = max(r["step"] for r in records)
    return {"steady": harness.steady_rate(intervals), "seconds": seconds,
            "tokens_per_step": sum(tokens for tokens, _ in intervals) / steps,
            "val_loss": [r["val/loss"] for r in records if "val/loss" in r][-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both arms, alternating")
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps of each run")
    parser.add_argument("--batch-size", type=int, default=16, help="examples a step, padded (packed: rows holding "
                                                                   "about as many)")
    parser.add_argument("--max-length", type=int, default=128, help="--max_length: packed rows hold this many tokens")
    parser.add_argument("--hidden", type=int, default=128, help="the tiny model's width")
    parser.add_argument("--layers", type=int, default=4, help="the tiny model's decoder layers")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of the training process")
    parser.add_argument("--quick", action="store_true", help="one short round on a smaller model: checks the script")
    parser.add_argument("--write-results", action="store_true", help="replace this script's section of RESULTS.md")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.hidden, args.layers = 1, 12, 64, 2
    harness.set_threads(args.threads)  # this process evaluates; and the machine line reports it
    info = harness.machine()

    with tempfile.TemporaryDirectory(prefix="finetune_packing_") as tmp:
        tmp = Path(tmp)
        model_dir, data_dir = harness.write_finetune_task(tmp, hidden=args.hidden, layers=args.layers,
                                                          train=400 if args.quick else 2000, val=64)
        rows, per_row = harness.rows_for_examples(model_dir, data_dir, args.batch_size, args.max_length)
        print(f"model: {args.layers} layers x {args.hidden}; packed: {per_row:.1f} examples a row of "
              f"{args.max_length} tokens, {rows} rows a step (padded: {args.batch_size} examples a step)")
        env = harness.clean_env(args.threads, HF_DATASETS_CACHE=str(tmp / "datasets-cache"))  # no trace in ~/.cache
        results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for round_ in range(args.rounds):
            for arm in ARMS if round_ % 2 == 0 else ARMS[::-1]:
                output_dir = tmp / f"{arm}-{round_}"
                argv = template_args(arm, model_dir, data_dir, output_dir, args, rows)
                results[arm].append(run_arm(arm, argv, output_dir, args.threads, env))
                r = results[arm][-1]
                print(f"round {round_ + 1} {arm}: {r['steady']:,.0f} tokens/s steady, {r['seconds']:.1f} s "
                      f"command, final val loss {r['val_loss']:.4f}", flush=True)
        commands = {arm: harness.launch_text("cpu.yaml", "templates/finetune_causal_lm.py",
                                             template_args(arm, Path("runs/tiny"), Path("runs/mixed"),
                                                           Path(f"runs/{arm}"), args, rows)) for arm in ARMS}

    rows_out = []
    for arm in ARMS:
        runs = results[arm]
        rows_out.append([arm, f"{statistics.median(r['tokens_per_step'] for r in runs):,.0f}",
                         f"{statistics.median(r['steady'] for r in runs):,.0f}",
                         f"{statistics.median(r['seconds'] for r in runs):.1f}",
                         " / ".join(f"{r['val_loss']:.4f}" for r in runs)])
    steady = [p["steady"] / q["steady"] for p, q in zip(results["packed"], results["padded"])]
    whole = [q["seconds"] / p["seconds"] for p, q in zip(results["packed"], results["padded"])]
    losses = [p["val_loss"] - q["val_loss"] for p, q in zip(results["packed"], results["padded"])]
    body = harness.table(["arm", "non-padding tokens a step", "steady tokens/s (median)", "whole command s (median)",
                          "final val loss, each round"], rows_out)
    verdict = (f"packed / padded, {args.rounds} rounds: steady non-padding tokens/s {harness.spread(steady)}; "
               f"whole command speed (padded s / packed s) {harness.spread(whole)}; final val loss packed - padded "
               f"{harness.spread(losses)}")
    print(f"\n{body}\n\n{verdict}")
    if args.write_results and not args.quick:
        setup = (f"Model: scripts/make_tiny_model.py, {args.layers} layers x {args.hidden}; data: the mixed-length "
                 f"reverse task (`harness.mixed_length_task`: completions of 1-12 repeats, 10-59 tokens an example), "
                 f"2,000 training and 64 validation examples; {args.steps} steps, learning rate 1e-3, warmup 10 + "
                 f"cosine; packed: {per_row:.1f} examples a row of {args.max_length} tokens, {rows} rows a step. "
                 f"The arms' commands (the folders are temporary ones in the run):\n\n```bash\n"
                 + "\n".join(commands.values()) + "\n```")
        harness.write_results("finetune_packing", "Fine-tuning: padded vs packed batches (CPU, 1 process)",
                              f"{setup}\n\n{body}\n\n{verdict}", info)


if __name__ == "__main__":
    main()
