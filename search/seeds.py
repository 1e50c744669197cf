"""Re-run one set of parameters with several seeds and report the metric as mean ± std.

    python -m search.seeds --results runs/search/image_classification/results.json --seeds 0,1,2
    python -m search.seeds --results runs/search/image_classification/results.json --trial 7
    python -m search.seeds --sweep sweeps/image_classification.yaml --seeds 0,1,2 -- --learning_rate=0.003

The parameters are the best trial's of a search (`--results`, written by `python -m search`), or the trial
`--trial` names, with the options that trial got after `--` (so a seed run repeats the trial but for
its seed); or, with only `--sweep`, the sweep's constants. Options after `--` here are added last
and win (e.g. `-- --epochs=100` for longer runs than the search's). Each seed
runs the sweep's command once, one after the other, with `--seed=<seed>` and its own `--output_dir`
<output_dir>/<name>/seed_<seed>. A seed's value is the metric's last logged value (what the search
optimizes too). The report, printed and saved to <output_dir>/<name>/seeds.json, lists every seed's
value, their mean, and their sample standard deviation (ddof=1; null with fewer than two seeds),
and the options the seeds ran with (`effective_args`: each parameter once, as the options after `--` left it).
Exit code 1 when a seed failed (its error is listed; the statistics use the seeds that completed).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import UsageError, with_exit_codes
from search.runner import have_matplotlib, parse_runner_config, split_passthrough
from search.sweep import build_command, check_command_files, effective_args, load_sweep, with_launch
from search.trial import run_trial, trial_env

REPORT_FILE = "seeds.json"
PICTURE_FILE = "seeds.png"  # beside seeds.json: each seed's curve of the metric, and their mean ± std
SYNOPSIS = "python -m search.seeds (--results FILE | --sweep FILE) [--option=VALUE ...] [-- <template options>]"


@dataclass
class SeedsConfig:
    """Re-run the best (or any) parameters of a sweep with several seeds; report mean and sample std."""

    results: str | None = field(default=None, metadata={
        "help": "results.json of a search: take its best trial's parameters."})
    trial: int = field(default=-1, metadata={"help": "With --results: this trial number instead of the best."})
    sweep: str | None = field(default=None, metadata={
        "help": "The sweep YAML (command, metric, constants); default: the one --results names."})
    program: str | None = field(default=None, metadata={
        "help": "The script to run instead of the sweep's `program`; default with --results: the search's."})
    config_file: str | None = field(default=None, metadata={
        "help": "The accelerate config instead of the command's --config_file; default with --results: the search's."})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Seeds to run, e.g. 0,1,2."})
    output_dir: str = field(default="runs/seeds", metadata={"help": "Runs go to <output_dir>/<name>/seed_<seed>."})
    name: str | None = field(default=None, metadata={
        "help": "Folder name under output_dir; default: the study's or sweep's name."})
    timeout_s: float = field(default=0.0, metadata={
        "help": "Stop and fail a run after this many seconds (0: no limit)."})
    grace_s: float = field(default=10.0, metadata={
        "help": "Seconds between SIGTERM and SIGKILL when a run is stopped."})

    def __post_init__(self):
        if not self.seeds:
            raise ValueError("seeds must list at least one seed")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must differ, got {self.seeds}")
        if self.results is None and self.sweep is None:
            raise ValueError("give --results (a search's results.json) or --sweep (a sweep file)")
        if self.results is None and self.trial != -1:
            raise ValueError("--trial needs --results")


def summarize(values: list[float]) -> dict:
    """Mean and sample standard deviation (ddof=1) of the values; std is None for fewer than two."""
    return {
        "n": len(values),
        "mean": statistics.fmean(values) if values else None,
        "std": statistics.stdev(values) if len(values) >= 2 else None,
        "std_kind": "sample standard deviation (ddof=1)",
    }


def read_results(path: str, trial: int) -> tuple[dict, dict]:
    """(the results file, the chosen trial's record)."""
    try:
        results = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"--results {path}: not found") from None
    except (OSError, ValueError) as error:
        raise UsageError(f"--results {path}: not a results.json of `python -m search` ({error})") from None
    if not isinstance(results, dict) or "trials" not in results:
        raise UsageError(f"--results {path}: not a results.json of `python -m search`")
    if trial == -1:
        if not results.get("best"):
            raise UsageError(f"--results {path}: the study has no complete trial yet")
        return results, results["best"]
    for record in results["trials"]:
        if record["number"] == trial:
            return results, record
    numbers = ", ".join(str(t["number"]) for t in results["trials"])
    raise UsageError(f"--results {path}: no trial {trial} (it has {numbers})")


def run_seeds(cfg: SeedsConfig, extra: list[str]) -> dict:
    if any(token.split("=")[0] in ("--output_dir", "--seed") for token in extra):
        raise UsageError("--seed/--output_dir after `--`: the runner sets them for every seed")
    params: dict = {}
    results = None
    source = "the sweep's constants"
    if cfg.results:
        results, record = read_results(cfg.results, cfg.trial)
        params = dict(record.get("args") or {})
        extra = [*record.get("extra_args", []), *extra]  # as the trial ran, then ours
        source = f"trial {record['number']} of {cfg.results}"
    sweep_path = cfg.sweep or (results or {}).get("sweep")
    program, config_file = cfg.program, cfg.config_file
    if results and not cfg.sweep:  # the sweep the search ran, launched as it launched it
        program, config_file = program or results.get("program"), config_file or results.get("config_file")
        for option, path in (("program", program), ("config_file", config_file)):
            if path and not getattr(cfg, option) and not Path(path).is_file():
                raise UsageError(f"--results {cfg.results}: the search's {option} {path} does not exist here "
                                 f"(relative to {os.getcwd()}); run where the search ran, or give --{option}")
    sweep = with_launch(load_sweep(sweep_path), program, config_file)
    check_command_files(sweep)
    if not cfg.results:
        params = sweep.constants()
    params.pop("seed", None)
    name = cfg.name or (results or {}).get("study_name") or sweep.name
    base = Path(cfg.output_dir) / name
    taken = [s for s in cfg.seeds if (base / f"seed_{s}").exists()]
    if taken:
        raise UsageError(f"{base} already holds runs for seed(s) {', '.join(map(str, taken))}; "
                         "choose another --output_dir or --name")
    # what each seed runs (but for --seed): an option after -- replaces a parameter
    ran = effective_args(params, extra)
    print(f"{len(cfg.seeds)} seeds of {source}: {shlex.join(ran)}", flush=True)

    runs = []
    curves: dict[int, list[tuple[int, float]]] = {}  # seed -> (step, value) at each evaluation
    for seed in cfg.seeds:
        out = base / f"seed_{seed}"
        argv = build_command(sweep, params, [*extra, f"--seed={seed}"], str(out))
        print(f"seed {seed}: {out}", flush=True)
        result = run_trial(argv, out, sweep.metric, env=trial_env(), timeout_s=cfg.timeout_s, grace_s=cfg.grace_s)
        if result.missing_metric:
            raise UsageError(f"seed {seed} finished without logging metric {sweep.metric!r} (it logged: "
                             f"{', '.join(result.logged_keys) or 'nothing'}); set metric.name in {sweep.path}")
        value = result.value if result.state == "complete" else None
        if value is not None and not math.isfinite(value):
            value, result.error = None, f"{sweep.metric} is not finite"
        curves[seed] = [(step, v) for step, v in result.evals if math.isfinite(v)]
        runs.append({
            "seed": seed,
            "state": "complete" if value is not None else "failed",
            "value": value,
            "evals": len(result.evals),
            "output_dir": str(out),
            "duration_s": round(result.duration_s, 2),
            "error": None if value is not None else result.error,
        })
        outcome = f"{sweep.metric} = {value:.6g}" if value is not None else f"failed, {result.error}"
        print(f"seed {seed}: " + outcome, flush=True)

    values = [run["value"] for run in runs if run["value"] is not None]
    report = {
        "metric": sweep.metric,
        "goal": sweep.goal,
        "sweep": str(sweep.path),
        "source": source,
        "params": params,
        "extra_args": list(extra),
        "effective_args": ran,
        "seeds": runs,
        **summarize(values),
    }
    base.mkdir(parents=True, exist_ok=True)
    path = base / REPORT_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
    print(format_report(report), flush=True)
    print(f"report: {path}", flush=True)
    if have_matplotlib(PICTURE_FILE):
        try:
            draw_seeds(curves, [run["seed"] for run in runs if run["value"] is not None], sweep.metric,
                       base / PICTURE_FILE, about=f"{source}: {shlex.join(ran) or 'its defaults'}")
            print(f"picture: {base / PICTURE_FILE}", flush=True)
        except Exception as error:  # the report stands without its picture
            print(f"warning: {PICTURE_FILE} could not be drawn ({type(error).__name__}: {error})", file=sys.stderr,
                  flush=True)
    if len(values) < len(runs):
        raise SystemExit(1)
    return report


def seed_band(curves: dict[int, list[tuple[int, float]]], complete: list[int]) -> tuple[list, list, list]:
    """(steps, mean, sample std) over the complete seeds at each step where every one of them evaluated; nothing
    with fewer than two complete seeds."""
    if len(complete) < 2:
        return [], [], []
    at_step = [dict(curves[seed]) for seed in complete]
    steps = sorted(set.intersection(*(set(points) for points in at_step)))
    columns = [[points[step] for points in at_step] for step in steps]
    return steps, [statistics.fmean(c) for c in columns], [statistics.stdev(c) for c in columns]


def draw_seeds(curves: dict[int, list[tuple[int, float]]], complete: list[int], metric: str, path: Path,
               about: str = ""):
    """Each seed's metric against step (failed seeds dashed, as far as they got) and the complete seeds' mean ±
    sample std as a band, under `about` (what ran: the trial and its settings); written to `path`, returns the
    Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from common.curves import save_figure

    figure = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    for index, (seed, points) in enumerate(curves.items()):
        if points:
            ax.plot([step for step, _ in points], [value for _, value in points], marker="o", markersize=3,
                    color=f"C{index}", linestyle="-" if seed in complete else "--",
                    label=f"seed {seed}" + ("" if seed in complete else " (failed)"))
    steps, mean, std = seed_band(curves, complete)
    if steps:
        ax.plot(steps, mean, color="black", linewidth=2, label=f"mean of {len(complete)} seeds")
        ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color="black", alpha=0.15, label="± sample std (ddof=1)")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} by seed")
    if about:  # which trial, with which settings: the picture alone says what was repeated
        figure.suptitle(textwrap.fill(about, 110), fontsize="small")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize="small")
    save_figure(figure, path)
    return figure


def format_report(report: dict) -> str:
    lines = [f"{'seed':>6}  {report['metric']}"]
    for run in report["seeds"]:
        outcome = f"{run['value']:.6g}" if run["value"] is not None else f"failed: {run['error']}"
        lines.append(f"{run['seed']:>6}  " + outcome)
    if report["mean"] is None:
        lines.append("no seed completed")
    elif report["std"] is None:
        lines.append(f"{report['metric']}: {report['mean']:.6g} (one seed: no standard deviation)")
    else:
        lines.append(f"{report['metric']}: {report['mean']:.6g} ± {report['std']:.3g} "
                     f"(mean ± sample std, ddof=1, over {report['n']} seeds)")
    return "\n".join(lines)


@with_exit_codes
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, extra = split_passthrough(argv)
    cfg = parse_runner_config(SeedsConfig, own, "python -m search.seeds ...", SYNOPSIS)
    return run_seeds(cfg, extra)


if __name__ == "__main__":
    main()
