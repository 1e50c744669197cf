"""The picture of a run: `<output_dir>/curves.png`, drawn from its metrics.jsonl at the end of every run and by
scripts/plot_runs.py for several runs side by side. Only the standard library at import (matplotlib when it draws),
so the plots are drawn on a machine without torch, accelerate or tqdm."""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import re
from pathlib import Path

METRICS_FILE = "metrics.jsonl"  # what a template logs, one JSON record a line
CURVES_FILE = "curves.png"
NOT_PLOTTED = ("step", "time", "epoch")  # the x axis, and what only restates it
Series = dict[str, tuple[list[int], list[float]]]  # metric -> (steps, values), one value a step, steps ascending


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl; a line cut short by a crash is skipped."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def metric_series(records: list[dict]) -> Series:
    """Each numeric metric against step: the last value logged at a step wins, so a step logged again (before a
    resume truncated the file) appears once. Non-finite values (written as null) and text are left out."""
    by_key: dict[str, dict[int, float]] = {}
    for record in records:
        for key, value in record.items():
            if key in NOT_PLOTTED or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                by_key.setdefault(key, {})[record["step"]] = float(value)
    return {key: (sorted(points), [points[step] for step in sorted(points)]) for key, points in by_key.items()}


def curve_panels(runs: list[Series]) -> list[tuple[str, list[str]]]:
    """(title, metrics) per panel: the losses together, the learning rate, the throughputs together, then every
    other validation metric that changes in some run (a constant tells nothing; each panel costs drawing time)."""
    keys = sorted({key for series in runs for key in series})
    losses = sorted((k for k in keys if k == "loss" or k.endswith("/loss")),
                    key=lambda k: (not k.startswith("train"), k))  # training first
    speeds = [k for k in keys if k.endswith("_per_s")]
    panels = [("loss", losses), ("learning rate", [k for k in keys if k == "lr"]), ("throughput (per second)", speeds)]
    grouped = set(losses) | set(speeds) | {"lr"}
    for key in keys:
        if key.startswith("val/") and key not in grouped and any(len(set(series.get(key, ((), ()))[1])) > 1
                                                                   for series in runs):
            panels.append((key, [key]))
    return [(title, members) for title, members in panels if members]


def best_checkpoint_step(output_dir: str | os.PathLike) -> int | None:
    """The step of the run's best checkpoint that finished saving (`checkpoints/best_step_XXXXXXXX/`), if any."""
    steps = [int(path.name[len("best_step_"):]) for path in Path(output_dir, "checkpoints").glob("best_step_*")
             if re.fullmatch(r"best_step_\d{8}", path.name) and (path / "progress.json").is_file()]
    return max(steps, default=None)


def items_seen(series: Series, unit: str):
    """A function of step: the items (`unit`: images, tokens) trained on up to that step, every process's, from the
    `<unit>_per_step` logged with each training loss (covering the steps since the one before); None without it."""
    if f"{unit}_per_step" not in series:
        return None
    steps, rates = series[f"{unit}_per_step"]
    seen = list(itertools.accumulate((step - before) * rate for step, before, rate in zip(steps, [0, *steps], rates)))

    def at(step: float) -> float:
        i = min(bisect.bisect_left(steps, step), len(steps) - 1)  # the first logged step at or after: its rate
        return seen[i] - (steps[i] - step) * rates[i]
    return at


def curves_figure(runs: dict[str, Series], best_steps: dict[str, int | None], title: str = "", x: str = "step"):
    """A matplotlib Figure (Agg canvas, no display) with the panels of `curve_panels` against `x`: the optimizer step,
    or the items seen (`items_seen`: "images", "tokens"). One line a metric, one colour a run when there are several
    (then line styles tell the metrics apart), each run's best checkpoint a dotted vertical line; legends beside."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = curve_panels(list(runs.values()))
    columns = 2 if len(panels) == 4 else min(3, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / columns))
    several = len(runs) > 1
    figure = Figure()
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(rows, columns, squeeze=False).flat)
    styles = ("-", "--", ":", "-.")
    for index, (ax, (panel, keys)) in enumerate(zip(axes, panels)):
        for r, (run, series) in enumerate(runs.items()):
            to_x = (lambda step: step) if x == "step" else items_seen(series, x)
            for k, key in enumerate(keys):
                if key not in series:
                    continue
                steps, values = series[key]
                name = key if not several else run if len(keys) == 1 else f"{run} {key}"
                ax.plot([to_x(step) for step in steps], values, label=name, color=f"C{r}" if several else f"C{k}",
                        linestyle=styles[k % len(styles)] if several else "-",
                        marker="o" if len(steps) <= 30 else None, markersize=3)
            best = best_steps.get(run)
            if best is not None:
                first = f"best checkpoint{f' of {run}' if several else ''} (step {best})"
                ax.axvline(to_x(best), color=f"C{r}" if several else "0.4", linestyle=":", linewidth=1.2,
                           label=first if index == 0 else "_best checkpoint")
        ax.set_title(panel)
        ax.set_xlabel("optimizer step" if x == "step" else f"{x} seen (all processes)")
        ax.grid(alpha=0.3)
        if any(not label.startswith("_") for label in ax.get_legend_handles_labels()[1]):
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    # Each legend beside its panel, as wide as its longest label: fixed margins (a layout engine doubles drawing time)
    labels = [label for ax in axes for label in ax.get_legend_handles_labels()[1] if not label.startswith("_")]
    legend, panel, gap = 0.6 + 0.075 * max(map(len, labels), default=0), 4.6, 0.9
    width = 0.75 + columns * panel + (columns - 1) * (legend + gap) + legend + 0.1
    figure.set_size_inches(width, 3.6 * rows + (0.4 if title else 0))
    height = figure.get_figheight()
    figure.subplots_adjust(left=0.75 / width, right=1 - (legend + 0.1) / width, wspace=(legend + gap) / panel,
                           hspace=0.55, bottom=0.5 / height, top=1 - (0.75 if title else 0.4) / height)
    for ax in axes[len(panels):]:
        ax.axis("off")
    if not panels:
        axes[0].text(0.5, 0.5, "nothing logged yet", ha="center", va="center", transform=axes[0].transAxes)
    if title:
        figure.suptitle(title)
    return figure


def save_figure(figure, path: str | os.PathLike) -> None:
    """Write `figure` as a PNG, atomically (a reader never sees half a picture)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        figure.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def draw_run_curves(output_dir: str | os.PathLike):
    """`<output_dir>/curves.png` from its metrics.jsonl and its best checkpoint; returns the Figure drawn."""
    output_dir = Path(output_dir)
    metrics = output_dir / METRICS_FILE
    series = metric_series(read_metrics(metrics)) if metrics.is_file() else {}
    figure = curves_figure({str(output_dir): series}, {str(output_dir): best_checkpoint_step(output_dir)},
                           title=str(output_dir))
    save_figure(figure, output_dir / CURVES_FILE)
    return figure
