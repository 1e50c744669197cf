"""Scaling: throughput as the model grows (3 sizes per template), and 2 DDP ranks against 1 on the CPU.

Model sizes: each template's own main(argv) in this process, one CPU thread, the middle size
being the template's default model, one smaller and one larger (derived from the defaults); the
median step time after start-up gives images/s or tokens/s (and, for the language model, the model
FLOP/s that makes: the template's own count, 6 x parameters + attention per token). Batch sizes
are the templates' defaults at every size.

DDP: real `accelerate launch` runs of each template's default model, 1 process
(accelerate_configs/cpu.yaml) against 2 ranks (accelerate_configs/cpu_ddp.yaml: gloo) at the same
batch per rank, one thread per process; the aggregate throughput ratio would be 2.0 with perfect
scaling and two idle cores. A 1-process run with 2 threads shows what the same two cores give
without DDP. Informational on a 2-core machine shared with other work.

Tracking is off here (--tracker none): it does not change how a model scales; bench/overhead.py
measures its cost.

    python bench/scaling.py                 # ~2-3 minutes on 2 busy cores
    python bench/scaling.py --quick         # seconds: checks the script, measures nothing
    python bench/scaling.py --write-results # also update bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

IMAGE_RUN = ["--epochs", "2", "--tracker", "none"]
LM_RUN = ["--max_steps", "10", "--eval_every_steps", "0", "--sample_tokens", "0", "--tracker", "none"]
QUICK_IMAGE = ["--epochs", "2", "--batch_size", "256", "--tracker", "none"]
QUICK_LM = ["--batch_size", "2", "--block_size", "16", "--max_steps", "4", "--eval_every_steps", "0",
            "--eval_batches", "1", "--sample_tokens", "0", "--tracker", "none"]


def model_sizes(name: str) -> list[tuple[str, list[str]]]:
    """Smaller, the template's default, larger: derived from the template's current defaults."""
    cfg = harness.load_template(name).Config()
    if name == "image_classification":
        w, d = cfg.width, cfg.depth
        sizes = [(max(4, w // 2), max(1, d // 2)), (w, d), (2 * w, d + 1)]
        return [(f"width {a}, depth {b}" + (" (default)" if (a, b) == (w, d) else ""),
                 ["--width", str(a), "--depth", str(b)])
                for a, b in sizes]
    layers, width, heads = cfg.n_layer, cfg.n_embd, cfg.n_head
    sizes = [(layers, max(heads, width // 2)), (layers, width), (2 * layers, 2 * width)]
    return [(f"{a} layers, width {b}" + (" (default)" if (a, b) == (layers, width) else ""),
             ["--n_layer", str(a), "--n_embd", str(b)]) for a, b in sizes]


def steady(name: str, argv: list[str], probe: harness.Probe) -> tuple[float, int]:
    """(median step time after start-up, steps it is taken over)."""
    if name == "image_classification":
        module = harness.load_template(name)
        cfg = module.parse_config(module.Config, argv)
        first = len(probe.steps) // cfg.epochs  # leave the first epoch out
    else:
        first = min(2, len(probe.steps) - 1)
    w = harness.window(probe, first, len(probe.steps))
    return w.median_step, w.steps


def per_step(name: str, argv: list[str]) -> tuple[int, str, float | None]:
    """(items per step per process, unit, training FLOPs per item or None)."""
    module = harness.load_template(name)
    cfg = module.parse_config(module.Config, argv)
    if name == "image_classification":
        return cfg.batch_size, "images/s", None
    model = module.GPT(vocab_size=256, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                       n_embd=cfg.n_embd)
    return cfg.batch_size * cfg.block_size, "tokens/s", harness.flops_per_token(model, cfg.block_size)


def count_params(name: str, argv: list[str]) -> int:
    module = harness.load_template(name)
    cfg = module.parse_config(module.Config, argv)
    if name == "image_classification":
        model = module.build_model(cfg, module.load_datasets(cfg))
    else:
        model = module.GPT(vocab_size=256, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                           n_embd=cfg.n_embd)
    return sum(p.numel() for p in model.parameters())


def sizes(workdir: Path, quick: bool, rounds: int) -> list[list]:
    """Every size of both templates, `rounds` times over in rotation; the median of each size's medians."""
    plans = []
    templates = (("image_classification", QUICK_IMAGE if quick else IMAGE_RUN),
                 ("language_model", QUICK_LM if quick else LM_RUN))
    for name, run in templates:
        for label, size_args in model_sizes(name)[:1] if quick else model_sizes(name):
            plans.append((name, label, [*run, *size_args]))
    steps: dict[int, list[float]] = {i: [] for i in range(len(plans))}
    counted: dict[int, int] = {}
    for round_ in range(rounds):
        for i, (name, label, argv) in enumerate(plans):
            out = workdir / f"size-{i}-{round_}"
            probe = harness.run_template(name, [*argv, "--output_dir", str(out)], log_path=workdir / f"size-{i}.log")
            step, counted[i] = steady(name, argv, probe)
            steps[i].append(step)
            print(f"  round {round_}: {name}, {label}: median step {1000 * step:.1f} ms over {counted[i]} steps",
                  flush=True)
            shutil.rmtree(out, ignore_errors=True)
    rows = []
    for i, (name, label, argv) in enumerate(plans):
        step = statistics.median(steps[i])
        items, unit, flops = per_step(name, argv)
        rate = items / step
        gflops = f"{flops * rate / 1e9:.1f}" if flops else "-"
        spread = f"{1000 * min(steps[i]):.1f}-{1000 * max(steps[i]):.1f}"
        rows.append([name, label, f"{count_params(name, argv):,}", f"{1000 * step:.1f} ({spread})",
                     f"{rate:,.0f} {unit}", gflops, f"{counted[i]} x {len(steps[i])}"])
    return rows


def ddp(workdir: Path, quick: bool) -> list[list]:
    rows = []
    plans = [("image_classification", ["--epochs", "3", "--tracker", "none"]), ("language_model", LM_RUN)]
    variants = [("1 process, 1 thread", "cpu.yaml", 1, 1), ("2 DDP ranks, 1 thread each", "cpu_ddp.yaml", 2, 1),
                ("1 process, 2 threads", "cpu.yaml", 1, 2)]
    if quick:  # one launch: the 2-rank path
        plans, variants = [("language_model", QUICK_LM)], variants[1:2]
    for name, argv in plans:
        items, unit, _ = per_step(name, argv)
        base = None
        for label, config, processes, threads in variants:
            out = workdir / f"ddp-{len(rows)}"
            done, probes = harness.launch(config, f"{name}", [*argv, "--output_dir", str(out)],
                                          probe_prefix=workdir / f"probe-{len(rows)}",
                                          num_processes=processes, threads=threads, timeout=600)
            if done.returncode != 0 or 0 not in probes:
                raise RuntimeError(f"{name} under {config} failed ({done.returncode}):\n"
                                   f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
            step, n = steady(name, argv, probes[0])
            rate = processes * items / step
            base = base or rate
            rows.append([name, label, f"{items:,} per process", f"{1000 * step:.1f}", f"{rate:,.0f} {unit}",
                         f"{rate / base:.2f}x", n])
            print(f"  {name}, {label}: median step {1000 * step:.1f} ms over {n} steps, {rate:,.0f} {unit} in all",
                  flush=True)
            shutil.rmtree(out, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["sizes", "ddp"], help="run one of the two parts")
    parser.add_argument("--rounds", type=int, default=2, help="model sizes: rounds over all sizes, in rotation")
    parser.add_argument("--quick", action="store_true",
                        help="tiny runs that only check the script works (no meaningful figures)")
    parser.add_argument("--write-results", action="store_true",
                        help="update the scaling section of bench/RESULTS.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 1
    harness.set_threads(1)
    info = harness.machine()
    print(harness.describe_machine(info))
    workdir = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    started = time.perf_counter()
    texts = []
    try:
        if args.only in (None, "sizes"):
            rows = sizes(workdir, args.quick, args.rounds)
            heading = f"Model size (one process, one thread; {args.rounds} rounds, sizes in rotation):\n\n"
            texts.append(heading + harness.table(
                ["template", "model", "parameters", "median step ms (per-round range)", "throughput", "model GFLOP/s",
                 "steps x rounds"], rows))
        if args.only in (None, "ddp"):
            rows = ddp(workdir, args.quick)
            texts.append("DDP on the CPU (gloo), same batch per process:\n\n" + harness.table(
                ["template", "processes", "batch", "median step ms (rank 0)", "throughput, all ranks",
                 "vs 1 process, 1 thread", "steps timed"], rows))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = "\n\n".join(texts)
    print()
    print(text)
    print(f"\n{time.perf_counter() - started:.0f}s")
    if args.write_results and not args.quick:
        harness.write_results("scaling", "Scaling: model size, and 2 DDP ranks vs 1 (CPU, informational)",
                              text + NOTES, info)


NOTES = """

- Model sizes: image template on digits (8x8 images), median over epoch 2; language model median
  over steps 3-10; default batch sizes; `--tracker none`.
- DDP: the default models and per-rank batch sizes; rank 0's median step time; throughput counts
  every rank's samples. On 2 cores shared with other users the
  2-rank figure is bounded by whatever the other users leave free; it is not a scaling claim for
  GPUs, where DDP's gradient all-reduce runs on NCCL and overlaps the backward pass.
"""


if __name__ == "__main__":
    main()
