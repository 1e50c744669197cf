"""GPU: the language-model template at GPT-2 small size (124M parameters), bf16, --compile, on one GPU:
tokens/s and MFU; and the image template's images/s. Prints a final table; under 8 minutes.

Both templates run through `accelerate launch --config_file accelerate_configs/single_gpu.yaml`
(the real user path), via bench/launch_entry.py, which times every optimizer step inside the
template's own main(). Throughput is taken over the steady state, after the steps that include
torch.compile's compilation and warm-up; evaluation and checkpoint time are left out of it.

Language model: GPT-2 small (12 layers, 12 heads, width 768, 1024 tokens of context, vocabulary
50304 = GPT-2's 50257 padded to a multiple of 64: 124M parameters), 16 sequences a step, AdamW
(fused on CUDA), bf16 autocast, each transformer block compiled. Data: token files made here from
the Python standard library's sources, two bytes to a token id below 50257 (no tokenizer or
download on the GPU machine; the model learns something, and throughput does not depend on what
the tokens are). MFU = the template's FLOPs per token (6 x parameters without the position table
+ 12 x layers x width x context) x tokens/s / the GPU's dense bf16 peak (the template's table,
e.g. 989 TFLOP/s for an H100 SXM or H200; --peak_tflops to override). The template's own logged
tokens_per_s and mfu (metrics.jsonl) are shown beside the harness's figures as a cross-check.

Image: the template's defaults on digits (batch 64 of 8x8 images: far too small to load a GPU;
the figure shows the loop's per-step cost on a GPU rather than the GPU's speed), plus one run at
batch 1024.

    python bench/gpu.py                  # on a GPU machine
    python bench/gpu.py --dry-run        # print the commands it would run, run nothing
    python bench/gpu.py --smoke          # the same code path on the CPU: tiny model, a few steps
    python bench/gpu.py --json results.json --write-results
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

TARGET_MFU = 0.45
GPT2_SMALL = ["--n_layer", "12", "--n_head", "12", "--n_embd", "768", "--block_size", "1024", "--vocab_size", "50304"]
SMOKE_MODEL = ["--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--block_size", "64", "--vocab_size", "50304"]


def write_tokens(root: Path, tokens_wanted: int | None) -> Path:
    """train.bin / val.bin of uint16 ids < 50257: the stdlib sources, two bytes per token."""
    module = harness.load_template("language_model")
    _, files = module.stdlib_sources()
    data = module.read_text_files(files)
    data = data[: len(data) // 2 * 2]
    if tokens_wanted:
        data = data[: 2 * tokens_wanted]
    tokens = ((data[0::2].astype(np.uint32) * 256 + data[1::2]) % 50257).astype(np.uint16)
    cut = len(tokens) - max(len(tokens) // 50, 16 * 1025)
    root.mkdir(parents=True, exist_ok=True)
    tokens[:cut].tofile(root / "train.bin")
    tokens[cut:].tofile(root / "val.bin")
    return root


def plans(args, data: Path, workdir: Path) -> list[dict]:
    """The runs: (label, template, accelerate config, template args, steps to skip as warm-up)."""
    precision = ["--mixed_precision", "bf16"]
    compile_flag = ["--compile", "true"] if args.compile else []
    peak = ["--peak_tflops", str(args.peak_tflops)] if args.peak_tflops else []
    if args.smoke:
        lm = [*SMOKE_MODEL, "--batch_size", "4", "--max_steps", "8", "--warmup_steps", "2", "--log_every_steps", "2",
              "--eval_batches", "1"]
        image = [["--epochs", "2"], ["--epochs", "2", "--batch_size", "256"]]
        peak = peak or ["--peak_tflops", "1"]  # exercises the MFU path on the CPU (a made-up peak)
        warmup = 2
    else:
        lm = [*GPT2_SMALL, "--batch_size", str(args.batch_size), "--max_steps", str(args.steps), "--warmup_steps", "30",
              "--learning_rate", "6e-4", "--log_every_steps", "10", "--eval_batches", "4"]
        image = [["--epochs", "10"], ["--epochs", "20", "--batch_size", "1024"]]
        warmup = args.warmup_steps
    common = ["--eval_every_steps", "0", "--sample_tokens", "0"]
    runs = [{"label": "language model, GPT-2 small" if not args.smoke else "language model (smoke: tiny)",
             "template": "language_model", "config": "single_gpu.yaml",
             "args": [*lm, *common, "--data_path", str(data), *precision, *compile_flag, *peak,
                      "--tracker", args.tracker, "--output_dir", str(workdir / "lm")],
             "warmup": warmup, "timeout": args.lm_timeout}]
    for i, extra in enumerate(image):
        batch_size = 64 if "--batch_size" not in extra else extra[-1]
        runs.append({"label": f"image, digits, batch {batch_size}", "template": "image_classification",
                     "config": "single_gpu.yaml",
                     "args": [*extra, *precision, "--tracker", args.tracker,
                              "--output_dir", str(workdir / f"image{i}")],
                     "warmup": None, "timeout": args.image_timeout})
    return runs


def command_text(run: dict, probe_prefix: Path) -> str:
    return harness.launch_text(run["config"], "bench/launch_entry.py",
                               [run["template"], str(probe_prefix), "--", *run["args"]])


def logged(output_dir: Path, key: str, after: int) -> float | None:
    """The median of a logged figure over the steps after `after` (None if never logged)."""
    values = [r[key] for r in harness.read_metrics(output_dir) if r.get(key) is not None and r["step"] > after]
    return statistics.median(values) if values else None


def analyse(run: dict, probe: harness.Probe) -> dict:
    module = harness.load_template(run["template"])
    cfg = module.parse_config(module.Config, run["args"])
    n = len(probe.steps)
    if run["template"] == "image_classification":
        first = n // cfg.epochs  # the first epoch: CUDA context, cuDNN autotuning, allocator warm-up
        items, unit = cfg.batch_size, "images/s"
    else:
        first = min(run["warmup"], n - 2)
        items, unit = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps, "tokens/s"
    w = harness.window(probe, max(1, first), n)
    out = {"label": run["label"], "steps": w.steps, "median_step_ms": 1000 * w.median_step, "unit": unit,
           "median_rate": items / w.median_step, "window_rate": items * w.steps / (w.seconds - w.ckpt_seconds),
           "first_step_s": probe.steps[0] - probe.info["loop_start"] if "loop_start" in probe.info else None}
    if run["template"] == "language_model":
        model = module.GPT(vocab_size=cfg.vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                           n_head=cfg.n_head, n_embd=cfg.n_embd)
        out["params"] = sum(p.numel() for p in model.parameters())
        out["flops_per_token"] = harness.flops_per_token(model, cfg.block_size)
        out["logged_tokens_per_s"] = logged(Path(cfg.output_dir), "tokens_per_s", first)
        out["logged_mfu"] = logged(Path(cfg.output_dir), "mfu", first)
        out["logged_peak_memory_gb"] = logged(Path(cfg.output_dir), "peak_memory_gb", 0)
    return out


def measure(run: dict, prefix: Path, *, timeout: float | None = None, threads: int = 0) -> tuple[dict | None, str]:
    """Launch one planned run and analyse its probe: (result, ""), or (None, why it failed) after printing
    the end of its output. A run past its timeout is killed, with the processes it started."""
    t0 = time.perf_counter()
    try:
        done, probes = harness.launch(run["config"], run["template"], run["args"], probe_prefix=prefix,
                                      threads=threads, timeout=run["timeout"] if timeout is None else timeout)
    except subprocess.TimeoutExpired as error:
        return None, f"timed out after {error.timeout:.0f}s (killed)"
    if done.returncode != 0 or 0 not in probes:
        print(done.stdout[-3000:], done.stderr[-5000:], sep="\n", flush=True)
        last_error_line = (done.stderr.strip().splitlines() or [""])[-1]
        return None, f"exit {done.returncode}: {last_error_line}"
    result = analyse(run, probes[0])
    result["wall_s"] = time.perf_counter() - t0
    return result, ""


def mfu(result: dict, peak: float | None) -> float | None:
    """Model FLOPs utilisation of a language-model result at the median step's rate (None without a peak)."""
    if "flops_per_token" not in result or not peak:
        return None
    return result["flops_per_token"] * result["median_rate"] / (peak * 1e12)


def peak_tflops(args) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops
    import torch

    if not torch.cuda.is_available():
        return 1.0 if args.smoke else None
    module = harness.load_template("language_model")
    return module.device_peak_tflops(torch.device("cuda", 0), 0.0)


def build_parser() -> argparse.ArgumentParser:
    """The options; bench/gpu_check.py takes its defaults from here too."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU: the same launches with a tiny model and a few steps")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="leave out --compile (default: on)")
    parser.add_argument("--batch_size", type=int, default=16, help="language model: sequences of 1024 tokens a step")
    parser.add_argument("--steps", type=int, default=300, help="language model: optimizer steps")
    parser.add_argument("--warmup-steps", type=int, default=50,
                        help="language model: steps left out as compile/warm-up")
    parser.add_argument("--peak_tflops", type=float, default=0.0,
                        help="the GPU's dense bf16 peak (0: the template's table)")
    parser.add_argument("--tracker", default="wandb",
                        help="the templates' tracker (default: wandb, offline without credentials)")
    parser.add_argument("--lm-timeout", type=int, default=330, help="seconds for the language-model run")
    parser.add_argument("--image-timeout", type=int, default=60, help="seconds for each image run")
    parser.add_argument("--json", help="also write the results as JSON to this file")
    parser.add_argument("--write-results", action="store_true", help="update the GPU section of bench/RESULTS.md")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import torch

    if not (args.smoke or args.dry_run or torch.cuda.is_available()):
        sys.exit("error: no GPU here; use --smoke (the same code path on the CPU) or --dry-run")
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    data = workdir / "tokens"
    runs = plans(args, data, workdir)
    if args.dry_run:
        for i, run in enumerate(runs):
            print(command_text(run, workdir / f"probe{i}"))
        shutil.rmtree(workdir, ignore_errors=True)
        return
    info = harness.machine()
    print(harness.describe_machine(info), flush=True)
    write_tokens(data, 400_000 if args.smoke else None)
    results, failures = [], []
    try:
        for i, run in enumerate(runs):
            prefix = workdir / f"probe{i}"
            print(f"{run['label']}: {command_text(run, prefix)}", flush=True)
            result, failure = measure(run, prefix)
            if result is None:
                failures.append(f"{run['label']}: {failure}")
                print(f"  failed: {failure}", flush=True)
                continue
            results.append(result)
            print(f"  {result['median_rate']:,.0f} {result['unit']} "
                  f"(median step {result['median_step_ms']:.1f} ms over {result['steps']} steps), "
                  f"run {result['wall_s']:.0f}s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    peak = peak_tflops(args)
    rows = []
    for r in results:
        mfu_text, utilisation = "-", mfu(r, peak)
        if utilisation is not None:
            verdict = "" if args.smoke else (" met" if utilisation >= TARGET_MFU else " MISSED")
            mfu_text = f"{utilisation:.1%}{verdict}"
        logged_text = "-"
        if r.get("logged_tokens_per_s"):
            logged_mfu_text = f", MFU {r['logged_mfu']:.1%}" if r.get("logged_mfu") else ""
            logged_text = f"{r['logged_tokens_per_s']:,.0f}" + logged_mfu_text
        rows.append([r["label"], f"{r.get('params', 0):,}" if "params" in r else "-", f"{r['median_step_ms']:.1f}",
                     f"{r['median_rate']:,.0f} {r['unit']}", f"{r['window_rate']:,.0f}", mfu_text, logged_text,
                     f"{r['first_step_s']:.0f}" if r.get("first_step_s") is not None else "-", r["steps"]])
    gpu = info["gpu"] or "no GPU (smoke run on the CPU: not a measurement)"
    text = harness.table(["run", "parameters", "median step ms", "throughput (median step)",
                          "throughput (whole window)", f"MFU (target >= {TARGET_MFU:.0%})",
                          "template's own log: tokens/s, MFU",
                          "first step s (compile)", "steps timed"], rows)
    peak_text = peak if peak else "unknown (pass --peak_tflops)"
    footer = f"GPU: {gpu}; peak used for MFU: {peak_text} TFLOP/s; total {time.perf_counter() - started:.0f}s"
    print()
    print(text)
    print(footer)
    for failure in failures:
        print(f"FAILED: {failure}")
    if args.json:
        summary = {"machine": info, "results": results, "failures": failures, "peak_tflops": peak}
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if args.write_results and not args.smoke:
        harness.write_results("gpu", "GPU: GPT-2 small (bf16, --compile) and the image template on one GPU",
                              text + "\n\n" + footer, info)
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
