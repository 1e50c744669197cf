#!/usr/bin/env python
"""Plot the curves of one or several runs side by side, from their metrics.jsonl alone (no torch needed).

    python scripts/plot_runs.py runs/image_classification                  # -> runs/image_classification/curves.png
    python scripts/plot_runs.py runs/a runs/b runs/c -o compare.png       # one line a run in every panel
    python scripts/plot_runs.py runs/a runs/b --x images                   # against the images trained on

The panels are those of the `curves.png` a run draws at its end (common/curves.py): the losses, the learning
rate, the throughput, then every other metric that changes; each run in its own colour, labelled by its folder,
its best checkpoint marked. The x axis is the optimizer step, or with `--x images` / `--x tokens` what the run
trained on (every process's): runs of other batch sizes, accumulation or process counts compare at equal data (a
step of a 2-process run holds twice the examples). Default output: <run>/curves.png for one run, curves.png here
for several.
A folder without metrics.jsonl is one `error:` line and exit code 2, with nothing written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from common.errors import UsageError, with_exit_codes  # noqa: E402
from common.curves import (  # noqa: E402
    CURVES_FILE,
    METRICS_FILE,
    best_checkpoint_step,
    curves_figure,
    items_seen,
    metric_series,
    read_metrics,
    save_figure,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (a template's --output_dir), each with a metrics.jsonl")
    parser.add_argument("--x", default="step", choices=("step", "images", "tokens"),
                        help="the x axis: optimizer steps, or the images (image template) or tokens (language model, "
                             "fine-tuning) trained on, every process's (default: step)")
    parser.add_argument("-o", "--output", help=f"the PNG to write; default <run>/{CURVES_FILE} for one run, "
                                               f"./{CURVES_FILE} for several")
    return parser.parse_args(argv)


@with_exit_codes
def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    folders = [Path(run) for run in args.runs]
    for folder in folders:
        if not (folder / METRICS_FILE).is_file():
            raise UsageError(f"{folder}: no {METRICS_FILE} here; give run folders (a template's --output_dir)")
    output = Path(args.output) if args.output else (folders[0] if len(folders) == 1 else Path()) / CURVES_FILE
    if not output.parent.is_dir():
        raise UsageError(f"-o {output}: the folder {output.parent} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("matplotlib is not installed: pip install matplotlib") from None
    labels = [str(run) for run in args.runs]
    runs = {label: metric_series(read_metrics(folder / METRICS_FILE)) for label, folder in zip(labels, folders)}
    without = [label for label, series in runs.items() if args.x != "step" and items_seen(series, args.x) is None]
    if without:
        raise UsageError(f"--x {args.x}: {', '.join(without)} logged no {args.x}_per_step (another template's unit, or "
                         f"a run of an older version): plot against --x step")
    best = {label: best_checkpoint_step(folder) for label, folder in zip(labels, folders)}
    save_figure(curves_figure(runs, best, title=", ".join(labels), x=args.x), output)
    print(f"wrote {output}")
    return output


if __name__ == "__main__":
    main()
