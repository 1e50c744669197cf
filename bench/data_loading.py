"""Data loading: the share of step time the training loop spends waiting for its next batch.

Each template runs through its real `main(argv)`, with its own datasets, `common.data.build_loader`
defaults (prefetch, persistent workers, pin_memory) and its own choice of loader workers
(the default `--num_workers`). The prepared training loader is wrapped so that every `next()`
the loop makes is timed; the wait share is that time over the steps' time, from the second epoch
(image) or the second step (language model) on, with evaluation and checkpoint time left out of
the steps' time. Four data sources, the default one of each template and the file-backed one:

  image, digits        the default: an in-memory tensor dataset (the template picks 0 workers)
  image, PNG folder    --data_dir: the digits written as PNG files, decoded and resized in workers
  language, stdlib     the default: the Python standard library's sources in memory (0 workers)
  language, token file --data_path: the same bytes as uint16 train.bin/val.bin, memory-mapped (0 workers)
  (and, for comparison, the token files read by one loader worker: --num_workers 1)

Models and batch sizes are the templates' defaults; only run lengths are shortened.

    python bench/data_loading.py                 # ~1-2 minutes on 2 busy cores
    python bench/data_loading.py --quick         # seconds: checks the script, measures nothing
    python bench/data_loading.py --write-results # also update bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

TARGET = 0.05


def write_png_folder(root: Path, limit: int | None = None) -> Path:
    """The digits as 8x8 grayscale PNG files, one folder per class (the ImageFolder layout)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    count = len(digits.images) if limit is None else limit
    for i in range(count):
        folder = root / str(digits.target[i])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((digits.images[i] * 255 / 16).astype(np.uint8)).save(folder / f"{i:05d}.png")
    return root


def write_token_files(root: Path, limit: int | None = None) -> Path:
    """The language template's default corpus (stdlib sources) as nanoGPT-style uint16 token files."""
    module = harness.load_template("language_model")
    _, files = module.stdlib_sources()
    data = module.read_text_files(files).astype(np.uint16)
    if limit is not None:
        data = data[:limit]
    root.mkdir(parents=True, exist_ok=True)
    cut = len(data) - len(data) // 10
    data[:cut].tofile(root / "train.bin")
    data[cut:].tofile(root / "val.bin")
    return root


def cases(workdir: Path, quick: bool) -> list[tuple[str, str, list[str]]]:
    png = write_png_folder(workdir / "digits_png", 200 if quick else None)
    tokens = write_token_files(workdir / "tokens", 200_000 if quick else None)
    if quick:
        image = ["--epochs", "2", "--width", "8", "--depth", "1", "--tracker", "none"]
        lm = ["--max_steps", "6", "--n_layer", "1", "--n_embd", "32", "--batch_size", "4", "--block_size", "32",
              "--eval_batches", "1", "--sample_tokens", "0", "--tracker", "none"]
        return [
            ("image, digits (default)", "image_classification", image),
            ("image, PNG folder", "image_classification",
             [*image, "--data_dir", str(png), "--image_size", "16", "--batch_size", "16"]),
            ("language, stdlib (default)", "language_model", lm),
            ("language, token files", "language_model", [*lm, "--data_path", str(tokens)]),
        ]
    image = ["--epochs", "3"]
    lm = ["--max_steps", "16", "--eval_every_steps", "0", "--sample_tokens", "0"]
    return [
        ("image, digits (default)", "image_classification", image),
        ("image, PNG folder", "image_classification", ["--epochs", "2", "--data_dir", str(png)]),
        ("language, stdlib (default)", "language_model", lm),
        ("language, token files", "language_model", [*lm, "--data_path", str(tokens)]),
        ("language, token files, --num_workers 1 (not the default)", "language_model",
         [*lm, "--data_path", str(tokens), "--num_workers", "1"]),
    ]


def first_step(name: str, argv: list[str], probe: harness.Probe) -> int:
    """Leave out start-up: the first epoch (image: iterators and workers start) or the first step."""
    if name == "image_classification":
        module = harness.load_template(name)
        cfg = module.parse_config(module.Config, argv)
        return len(probe.steps) // cfg.epochs
    return 1


def analyse(name: str, argv: list[str], probe: harness.Probe) -> dict:
    first = first_step(name, argv, probe)
    w = harness.window(probe, first, len(probe.steps))
    begin, end = probe.begins[first], probe.steps[-1]
    waits = [b - a for a, b in probe.waits if a >= begin and b <= end]
    busy = w.seconds - w.ckpt_seconds  # evaluation is already out of w.seconds
    return {"steps": w.steps, "median_step": w.median_step,
            "median_wait": statistics.median(waits) if waits else 0.0,
            "max_wait": max(waits) if waits else 0.0, "share": sum(waits) / busy}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads of the training process (0: torch's default)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny runs that only check the script works (no meaningful figures)")
    parser.add_argument("--keep", action="store_true", help="keep the generated data and run folders (printed)")
    parser.add_argument("--write-results", action="store_true",
                        help="update the data-loading section of bench/RESULTS.md")
    args = parser.parse_args(argv)
    harness.set_threads(args.threads)
    info = harness.machine()
    print(harness.describe_machine(info))
    workdir = Path(tempfile.mkdtemp(prefix="bench-data-"))
    started = time.perf_counter()
    rows = []
    try:
        for label, name, run_argv in cases(workdir, args.quick):
            out = workdir / f"run-{len(rows)}"
            probe = harness.run_template(name, [*run_argv, "--output_dir", str(out)], time_loader=True,
                                         log_path=workdir / f"run-{len(rows)}.log")
            result = analyse(name, run_argv, probe)
            i = probe.info
            worker_settings = f", prefetch {i['prefetch_factor']}, persistent" if i["num_workers"] else ""
            settings = f"{i['num_workers']} workers" + worker_settings + (", pinned" if i["pin_memory"] else "")
            verdict = "" if "not the default" in label else "met" if result["share"] < TARGET else "MISSED"
            rows.append([label, settings, result["steps"], f"{1000 * result['median_step']:.1f}",
                         f"{1000 * result['median_wait']:.2f}", f"{1000 * result['max_wait']:.1f}",
                         f"{result['share']:.2%} {verdict}".strip()])
            print(f"  {label}: {settings}; {result['steps']} steps; "
                  f"median step {1000 * result['median_step']:.1f} ms, "
                  f"median wait {1000 * result['median_wait']:.2f} ms; "
                  f"waiting {result['share']:.2%} of step time", flush=True)
    finally:
        if args.keep:
            print(f"data and runs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    text = harness.table(["data", "loader (template's choice)", "steps timed", "median step ms", "median wait ms",
                          "max wait ms", f"waiting, share of step time (target < {TARGET:.0%})"], rows)
    print()
    print(text)
    print(f"\n{time.perf_counter() - started:.0f}s")
    if args.write_results and not args.quick:
        harness.write_results("data_loading", "Data loading: time waiting for the next batch", text + NOTES, info)


NOTES = """

- The wait is each `next()` on the prepared training loader as the template's loop sees it
  (accelerate's DataLoaderShard, which fetches one batch ahead), over the steps' own time (from
  the second epoch of the image runs, the second step of the language runs; evaluation and
  checkpoint saves not counted as step time).
- Workers are the templates' defaults on this machine: the image template picks 0 for in-memory
  data and `common.data.default_num_workers()` for image files, i.e. (cores - 1) per process, here 1;
  the language template reads in the training process (0 workers) for text and token files alike.
- Default model sizes and batch sizes; the PNG folder is the 1797 digits as 8x8 PNG files, resized
  to the template's default 32x32 RGB (so the model is the default one for 32x32 images).
"""


if __name__ == "__main__":
    main()
