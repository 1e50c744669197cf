"""Local hyperparameter search with Optuna over a W&B sweep file: no account, no network.

    python -m search --sweep sweeps/image_classification.yaml --n_trials 30
    python -m search --sweep sweeps/image_classification.yaml --n_trials 30 -- --tracker=none

Options after `--` go to every trial after the sampled ones (so they win), e.g. a shorter run.
Each trial is one subprocess started from the sweep's `command` (usually `accelerate launch`, so a
trial may use DDP or FSDP), with its own `--output_dir` <output_dir>/<study>/trial_NNNN.
The sweep's `program` and the command's `--config_file` are paths from the working directory (as
for `wandb agent`); --program and --config_file replace them, e.g. a shipped sweep file in a copied project:

    python -m search --sweep sweep.yaml --program train.py --config_file cpu.yaml --n_trials 30

- Sampler: from `method` (bayes: TPE, random, grid), seeded with --seed and the trial number, so
  a single worker repeats itself and parallel workers never draw alike. Grid search runs every
  point of the grid once (a failed point is not retried) and then stops, whatever --n_trials says
  above the grid's size.
- Pruner: hyperband when the file has `early_terminate` (min_iter, eta; or max_iter and s), else
  median. Optuna's step is the evaluation's number (1, 2, ...), the unit W&B's hyperband counts
  in, so min_iter means the same to both and trials with different batch sizes compare.
  A trial that reported its final evaluation is complete, never pruned: the runner does not ask
  the pruner once a trial has made as many evaluations as a full trial (the most of --max_resource,
  the file's max_iter and any complete trial's count), and a trial whose process ended by itself
  while the pruner was asked is complete with its last value.
- Storage: a journal file, <output_dir>/<study>/journal.log by default; run the same command in
  more terminals for parallel workers. `--storage postgresql://user:pass@host/db` (or any
  SQLAlchemy URL) for workers on several machines.
- --n_trials is the study's total of finished trials (complete or pruned), over all workers and
  restarts: a stopped study continues where it was with the same command, and a second worker
  shares the budget. Failed trials do not count (a crash is retried); a worker gives up after
  --max_failures failed trials in a row. Workers that start trials at the same moment can
  overshoot the total by at most (workers - 1).
- A trial left RUNNING by a worker that died (killed, machine lost) is marked failed by the next
  worker that looks: at once when its process is gone on this machine, otherwise once its
  heartbeat is older than --stale_after_s.
- <output_dir>/<study>/results.json is rewritten from the storage after every trial and at the
  end, atomically and by one worker of the machine at a time (a lock file beside it), so the worker
  that finishes last leaves the final one ("final": true, no trial running). A worker that ends
  while others still run says so.
- An option the runner does not know is refused with a hint: options for the trials go after `--`.
- At the end: a table of the trials and the best trial's options as it ran them (its parameters,
  those replaced by options of the same name after `--`, then the options after `--`); results.json
  holds them too, as effective_args, and each trial's whole command as argv.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shlex
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ConfigError, format_help, parse_config
from common.errors import UsageError, with_exit_codes
from search.sweep import (
    Sweep,
    build_command,
    check_command_files,
    effective_args,
    effective_values,
    launcher_config_file,
    load_sweep,
    overridden_args,
    parse_options,
    with_launch,
)
from search.trial import run_trial, trial_env

SAMPLERS = ("auto", "tpe", "random", "grid")
PRUNERS = ("auto", "hyperband", "median", "none")
RESULTS_FILE = "results.json"
HISTORY_FILE = "optimization_history.png"  # beside results.json: each complete trial's value and the best so far
IMPORTANCES_FILE = "param_importances.png"  # how much each searched parameter moved the metric
SYNOPSIS = "python -m search --sweep FILE [--option=VALUE ...] [-- <template options>]"
AFTER_SEPARATOR = ("  -- <template options>\n"
                   "      Options for every run of the program (e.g. -- --epochs=10 --tracker=none), after the "
                   "sweep's values: they win.")


@dataclass
class SearchConfig:
    """Run (or continue) an Optuna study over a W&B sweep file; several workers may share it."""

    sweep: str = field(metadata={"help": "The sweep YAML (e.g. sweeps/image_classification.yaml)."})
    program: str | None = field(default=None, metadata={
        "help": "The script the trials run instead of the sweep's `program` (e.g. your copied train.py)."})
    config_file: str | None = field(default=None, metadata={
        "help": "The accelerate config the trials launch with instead of the sweep command's --config_file."})
    n_trials: int = field(default=20, metadata={
        "help": "Finished trials (complete or pruned) the study should have in total."})
    study_name: str | None = field(default=None, metadata={"help": "Default: the sweep's `name`, else its file name."})
    storage: str | None = field(default=None, metadata={
        "help": "Journal file path or database URL; default <output_dir>/<study>/journal.log."})
    output_dir: str = field(default="runs/search", metadata={"help": "Trials go to <output_dir>/<study>/trial_NNNN."})
    seed: int = field(default=0, metadata={"help": "Seeds the sampler (mixed with each trial's number)."})
    sampler: str = field(default="auto", metadata={
        "help": "auto (from method: bayes=tpe, random, grid), tpe, random or grid."})
    pruner: str = field(default="auto", metadata={
        "help": "auto (hyperband with early_terminate, else median), hyperband, median or none."})
    max_resource: int = field(default=0, metadata={
        "help": "Hyperband: evaluations of a full trial (0: max_iter, else learned from the first trial)."})
    median_startup_trials: int = field(default=5, metadata={
        "help": "Median pruner: finished trials before it stops any."})
    min_evals: int = field(default=1, metadata={
        "help": "Median pruner: evaluations every trial gets before it may be stopped."})
    trial_timeout_s: float = field(default=0.0, metadata={
        "help": "Stop and fail a trial after this many seconds (0: no limit)."})
    grace_s: float = field(default=10.0, metadata={
        "help": "Seconds between SIGTERM and SIGKILL when a trial is stopped."})
    heartbeat_s: float = field(default=30.0, metadata={"help": "How often a running trial's heartbeat is recorded."})
    stale_after_s: float = field(default=180.0, metadata={
        "help": "A RUNNING trial without heartbeat for this long is marked failed."})
    max_failures: int = field(default=3, metadata={"help": "Stop this worker after this many failed trials in a row."})

    def __post_init__(self):
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.pruner not in PRUNERS:
            raise ValueError(f"pruner must be one of {', '.join(PRUNERS)}, got {self.pruner!r}")
        for name in ("n_trials", "max_failures", "min_evals"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("heartbeat_s", "stale_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.stale_after_s <= 2 * self.heartbeat_s:
            raise ValueError(f"stale_after_s ({self.stale_after_s:g}) must exceed twice heartbeat_s "
                             f"({self.heartbeat_s:g})")


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """Options before `--` are the runner's; those after it go to every trial."""
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    return argv, []


def parse_runner_config(config_cls, own: list[str], usage: str, synopsis: str):
    """parse_config, with a hint on an unknown option: it may be one for the trials, which go after `--`.

    `usage` is how the runner starts, e.g. "python -m search --sweep ..."; `synopsis` is --help's usage line,
    with the `-- <template options>` that parse_config's own help does not know of.
    """
    if "-h" in own or "--help" in own:
        options = format_help(config_cls).split("\n", 1)[1]  # below parse_config's usage line
        try:
            print(f"usage: {synopsis}\n{options}\n{AFTER_SEPARATOR}", flush=True)
        except BrokenPipeError:  # `--help | head` stopped reading: fine, and nothing more to say at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    try:
        return parse_config(config_cls, own)
    except ConfigError as error:
        message = str(error)
        if not message.startswith("unknown option --"):
            raise
        known = {f.name for f in dataclasses.fields(config_cls)} | {"config"}
        moved = [shlex.join([written[0] if len(written) == 1 else f"{written[0]}={written[1]}"])
                 for name, _, written in parse_options(own) if name not in known]
        hint = f"options for the trials go after --: {usage} -- {' '.join(moved)}"
        # After parse_config's "(did you mean --x?)", kept as it is: a typo, or an option for the trials.
        message = f"{message}; {hint}" if message.endswith("?)") else f"{message} ({hint})"
        raise ConfigError(message) from None


# ------------------------------------------------------------------------------------- optuna
def _optuna():
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def hide_password(url: str) -> str:
    if "://" not in url:
        return url
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy knows: show the scheme only
        return url.split("://")[0] + "://..."


def open_storage(spec: str):
    """A journal file for a path, an RDB storage for a URL (postgresql://, sqlite:///, mysql://)."""
    optuna = _optuna()
    if "://" not in spec:
        path = Path(spec)
        path.parent.mkdir(parents=True, exist_ok=True)
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(str(path)))
    url = spec
    if url.startswith("postgresql://"):  # one driver whatever SQLAlchemy's default is: psycopg 3
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    for attempt in range(4):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True})
        except ImportError as error:  # optuna re-raises the driver's ModuleNotFoundError as a plain ImportError
            missing = getattr(error.__cause__, "name", None) or getattr(error, "name", None) or "for this URL"
            raise UsageError(f"--storage {hide_password(spec)}: the database driver {missing} is not installed "
                             f"(PostgreSQL: pip install 'psycopg[binary]')") from None
        except Exception as error:  # SQLAlchemy's errors: the server, the URL, the schema
            # Workers that start together race to create the tables; the losers try again.
            if type(error).__name__ in ("IntegrityError", "ProgrammingError", "InternalError") and attempt < 3:
                time.sleep(0.5 * (attempt + 1))
                continue
            text = " ".join(str(getattr(error, "orig", None) or error).split())
            raise UsageError(f"--storage {hide_password(spec)}: cannot open it ({text[:300]})") from None


def seed_for(seed: int, number: int) -> int:
    return (seed * 1_000_003 + number * 7_919 + 17) % (2**32)


def make_sampler(kind: str, sweep: Sweep, seed: int):
    """A sampler re-seeded before each trial from (seed, trial number).

    Optuna's samplers keep no state between trials beyond their random generator (everything else
    comes from the study's trials), so a fresh one per trial is exact; seeding it with the trial's
    number makes a single worker reproducible and keeps parallel workers from drawing alike.
    """
    optuna = _optuna()
    if kind == "auto":
        kind = {"bayes": "tpe", "random": "random", "grid": "grid"}.get(sweep.method, "tpe")
    if kind == "grid":
        # One sampler for good: grid point k is entry k of a shuffle fixed by the sampler's seed, which must
        # be the same in every worker, so it is a constant; trial k runs point k, no randomness is left.
        grid = optuna.samplers.GridSampler(sweep.grid_space(), seed=0)

        def factory(s):
            return grid
    elif kind == "random":
        def factory(s):
            return optuna.samplers.RandomSampler(seed=s)
    else:
        def factory(s):
            return optuna.samplers.TPESampler(seed=s, constant_liar=True)  # liar: parallel workers spread out

    class PerTrialSeeded(optuna.samplers.BaseSampler):
        def __init__(self):
            self.kind = kind
            self.inner = factory(seed)

        def before_trial(self, study, trial):
            self.inner = factory(seed_for(seed, trial.number))
            self.inner.before_trial(study, trial)

        def infer_relative_search_space(self, study, trial):
            return self.inner.infer_relative_search_space(study, trial)

        def sample_relative(self, study, trial, search_space):
            return self.inner.sample_relative(study, trial, search_space)

        def sample_independent(self, study, trial, param_name, param_distribution):
            return self.inner.sample_independent(study, trial, param_name, param_distribution)

        def after_trial(self, study, trial, state, values):
            try:
                self.inner.after_trial(study, trial, state, values)
            except RuntimeError:
                # GridSampler calls study.stop(), which works only inside optimize(); we count ourselves
                pass

    return PerTrialSeeded()


def make_pruner(kind: str, sweep: Sweep, cfg: SearchConfig):
    optuna = _optuna()
    early = sweep.early_terminate or {}
    if kind == "auto":
        kind = "hyperband" if early else "median"
    if kind == "none":
        return optuna.pruners.NopPruner(), "none"
    if kind == "median":
        pruner = optuna.pruners.MedianPruner(n_startup_trials=cfg.median_startup_trials, n_warmup_steps=cfg.min_evals)
        return pruner, f"median (after {cfg.median_startup_trials} trials, from evaluation {cfg.min_evals})"
    eta = early.get("eta", 3)
    if float(eta) != int(eta) or eta < 2:
        raise UsageError(f"sweep file {sweep.path}: early_terminate.eta must be a whole number >= 2 "
                         f"for Optuna's hyperband, got {eta}")
    eta = int(eta)
    if "min_iter" in early:
        min_resource, max_resource = int(early["min_iter"]), cfg.max_resource or "auto"
    elif "max_iter" in early:  # W&B's bands: max_iter / eta^i for i = 1..s
        max_resource = cfg.max_resource or int(early["max_iter"])
        min_resource = max(1, int(early["max_iter"] / eta ** early.get("s", 1)))
    else:
        min_resource, max_resource = 1, cfg.max_resource or "auto"
    pruner = optuna.pruners.HyperbandPruner(min_resource=min_resource, max_resource=max_resource, reduction_factor=eta)
    return pruner, f"hyperband (min {min_resource} evaluations, max {max_resource}, eta {eta})"


# --------------------------------------------------------------------------------- stale trials
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def fail_stale_trials(study, stale_after_s: float, host: str) -> list[int]:
    """Mark RUNNING trials whose worker is gone as failed; returns their numbers."""
    optuna = _optuna()
    now, failed = time.time(), []
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        worker = trial.user_attrs.get("worker") or {}
        beat = trial.user_attrs.get("heartbeat") or (trial.datetime_start.timestamp() if trial.datetime_start else now)
        if worker.get("host") == host and isinstance(worker.get("pid"), int) and not _pid_alive(worker["pid"]):
            reason = f"its worker (pid {worker['pid']} on {host}) is gone"
        elif now - beat > stale_after_s:
            reason = (f"no heartbeat from its worker ({worker.get('host', '?')}, pid {worker.get('pid', '?')}) "
                      f"for {now - beat:.0f} s")
        else:
            continue
        try:
            study._storage.set_trial_user_attr(trial._trial_id, "error", f"abandoned: {reason}")
            study._storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)
        except Exception:  # another worker got there first
            continue
        failed.append(trial.number)
        print(f"trial {trial.number}: marked failed, {reason}", flush=True)
    return failed


# ------------------------------------------------------------------------------------ the loop
class Interrupted(Exception):
    pass


def _raise_interrupted(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def fresh_dir(base: Path) -> Path:
    """`base`, or base-2, base-3 ... if a folder of that name is left from an earlier study."""
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def short(values: dict, sweep: Sweep) -> str:
    parts = []
    for name, value in values.items():
        if name in sweep.params and sweep.params[name].constant:
            continue
        parts.append(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}")
    return " ".join(parts)


def full_trial_evals(study, cfg: SearchConfig, sweep: Sweep) -> int:
    """How many evaluations a full trial makes, as far as the study knows; 0 while unknown.

    The most of: --max_resource and the sweep's early_terminate.max_iter (both declare it), and the
    evaluations of every complete trial in the storage (how Optuna's hyperband learns it).
    """
    optuna = _optuna()
    declared = cfg.max_resource or int((sweep.early_terminate or {}).get("max_iter") or 0)
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return max([declared, *(t.last_step for t in complete if t.last_step is not None)])


def run_one(study, sweep: Sweep, cfg: SearchConfig, extra: list[str], study_dir: Path, host: str) -> str:
    """Ask for a trial, run it, tell the study. Returns the trial's final state name."""
    optuna = _optuna()
    TrialState = optuna.trial.TrialState
    trial = study.ask()
    values = sweep.suggest(trial)
    out = fresh_dir(study_dir / f"trial_{trial.number:04d}")
    argv = build_command(sweep, values, extra, str(out))
    trial.set_user_attr("args", values)
    trial.set_user_attr("extra_args", list(extra))
    trial.set_user_attr("output_dir", str(out))
    trial.set_user_attr("argv", argv)
    trial.set_user_attr("worker", {"host": host, "pid": os.getpid()})
    trial.set_user_attr("heartbeat", time.time())
    print(f"trial {trial.number}: {short(effective_values(values, extra), sweep)} -> {out}", flush=True)

    last_beat = [time.monotonic()]
    reported = [0]

    def report(index: int, step: int, value: float) -> None:
        trial.report(value, index)
        reported[0] = index
        print(f"trial {trial.number}: evaluation {index} (step {step}): {sweep.metric} = {value:.6g}", flush=True)

    def should_prune() -> bool:
        # A trial that reported a full trial's last evaluation has done its work: it is complete, never pruned.
        # (Optuna's pruners would stop it there: hyperband at a rung that equals the full length, median at any step.)
        full = full_trial_evals(study, cfg, sweep)
        if full and reported[0] >= full:
            return False
        return trial.should_prune()

    def tick() -> None:
        if time.monotonic() - last_beat[0] >= cfg.heartbeat_s:
            trial.set_user_attr("heartbeat", time.time())
            last_beat[0] = time.monotonic()

    try:
        result = run_trial(argv, out, sweep.metric, report=report, should_stop=should_prune, tick=tick,
                           env=trial_env(), timeout_s=cfg.trial_timeout_s, grace_s=cfg.grace_s)
    except (KeyboardInterrupt, Interrupted):
        trial.set_user_attr("error", "interrupted: its worker was stopped")
        study.tell(trial, state=TrialState.FAIL)
        raise
    trial.set_user_attr("eval_steps", [step for step, _ in result.evals])
    trial.set_user_attr("duration_s", round(result.duration_s, 2))
    if result.state == "stopped":
        study.tell(trial, state=TrialState.PRUNED)
        print(f"trial {trial.number}: pruned after {len(result.evals)} evaluation(s) ({result.duration_s:.1f} s)",
              flush=True)
        return "pruned"
    if result.state == "complete" and not math.isnan(result.value):
        study.tell(trial, result.value)
        print(f"trial {trial.number}: complete, {sweep.metric} = {result.value:.6g} ({result.duration_s:.1f} s)",
              flush=True)
        return "complete"
    error = result.error or f"{sweep.metric} is NaN"
    trial.set_user_attr("error", error)
    study.tell(trial, state=TrialState.FAIL)
    print(f"trial {trial.number}: failed, {error} (log: {out / 'trial.log'})", flush=True)
    if result.missing_metric:
        logged = ", ".join(result.logged_keys) or "nothing"
        raise UsageError(f"trial {trial.number} finished without logging metric {sweep.metric!r} "
                         f"(it logged: {logged}); "
                         f"set metric.name in {sweep.path} to a metric the program logs")
    return "failed"


def search(cfg: SearchConfig, extra: list[str]) -> dict:
    optuna = _optuna()
    TrialState = optuna.trial.TrialState
    sweep = with_launch(load_sweep(cfg.sweep), cfg.program, cfg.config_file)
    check_command_files(sweep)  # a missing accelerate config would fail every trial with a traceback
    if any(token.split("=")[0] == "--output_dir" for token in extra):
        raise UsageError("--output_dir after `--`: the runner gives every trial its own; "
                         "set the runner's --output_dir instead")
    study_name = cfg.study_name or sweep.name
    study_dir = Path(cfg.output_dir) / study_name
    storage_spec = cfg.storage or str(study_dir / "journal.log")
    sampler = make_sampler(cfg.sampler, sweep, cfg.seed)
    pruner, pruner_text = make_pruner(cfg.pruner, sweep, cfg)
    storage = open_storage(storage_spec)
    try:
        study = optuna.create_study(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner,
                                    direction=sweep.direction, load_if_exists=True)
    except ValueError as error:  # e.g. the stored study optimizes in the other direction
        raise UsageError(f"study {study_name!r} in {hide_password(storage_spec)}: {error}") from None
    if study.direction.name.lower() != sweep.direction:
        raise UsageError(f"study {study_name!r} in {hide_password(storage_spec)} "
                         f"was created to {study.direction.name.lower()}, "
                         f"the sweep file says {sweep.direction}; use another --study_name")
    stored, current = study.user_attrs.get("sweep"), json.loads(json.dumps(sweep.config, default=str))
    if stored is None:
        study.set_user_attr("sweep", current)
        study.set_user_attr("sweep_path", str(sweep.path))
    elif stored != current:
        print(f"warning: study {study_name!r} was started with a different sweep (file content, --program or "
              "--config_file); "
              "its earlier trials still guide the sampler", file=sys.stderr, flush=True)

    target = cfg.n_trials
    if sampler.kind == "grid":
        grid_size = math.prod(len(v) for v in sweep.grid_space().values())
        target = min(target, grid_size)
    host = socket.gethostname()
    print(f"study {study_name!r} in {hide_password(storage_spec)}: {sweep.metric} ({sweep.goal}), "
          f"sampler {sampler.kind}, pruner {pruner_text}, {target} trials in total", flush=True)

    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in (signal.SIGTERM, signal.SIGHUP)}
    failures = 0
    try:
        while True:
            fail_stale_trials(study, cfg.stale_after_s, host)
            trials = study.get_trials(deepcopy=False)
            # Grid search tries each point once: a failed point counts as done (it would not be retried).
            ended = (TrialState.COMPLETE, TrialState.PRUNED) + ((TrialState.FAIL,) if sampler.kind == "grid" else ())
            done = sum(t.state in ended for t in trials)
            running = sum(t.state == TrialState.RUNNING for t in trials)
            if done + running >= target:
                break
            state = run_one(study, sweep, cfg, extra, study_dir, host)
            write_results(study, sweep, study_dir, storage_spec, target)  # current while the study runs
            failures = failures + 1 if state == "failed" else 0
            if failures >= cfg.max_failures:
                print(f"error: {failures} trials in a row failed; see their trial.log (this worker stops)",
                      file=sys.stderr, flush=True)
                break
    except (KeyboardInterrupt, Interrupted) as error:
        by = str(error) or "Ctrl-C"  # Interrupted carries the signal's name; Ctrl-C raises a bare KeyboardInterrupt
        print(f"error: interrupted by {by}; run the same command to continue the study", file=sys.stderr, flush=True)
        write_results(study, sweep, study_dir, storage_spec, target)
        raise SystemExit(130) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    results = write_results(study, sweep, study_dir, storage_spec, target)
    print(format_table(results, sweep), flush=True)
    print(f"results: {study_dir / RESULTS_FILE}", flush=True)
    draw_study(study, study_dir, sweep.metric)
    if not results["final"]:
        running = [t["number"] for t in results["trials"] if t["state"] == "running"]
        print(f"{len(running)} trial(s) still running in other workers ({', '.join(map(str, running))}): these results "
              "are not final; the worker that finishes last rewrites them", flush=True)
    if failures >= cfg.max_failures:
        raise SystemExit(1)
    return results


# ---------------------------------------------------------------------------------- reporting
def trial_record(trial) -> dict:
    return {
        "number": trial.number,
        "state": trial.state.name.lower(),
        "value": trial.value if trial.value is None or math.isfinite(trial.value) else None,
        "evals": len(trial.intermediate_values),
        "last_eval": trial.intermediate_values[max(trial.intermediate_values)] if trial.intermediate_values else None,
        "args": trial.user_attrs.get("args", {}),
        "extra_args": trial.user_attrs.get("extra_args", []),
        # what ran: the parameters, each replaced by an option of the same name after `--`, then those options
        "effective_args": effective_args(trial.user_attrs.get("args", {}), trial.user_attrs.get("extra_args", [])),
        "argv": trial.user_attrs.get("argv"),
        "output_dir": trial.user_attrs.get("output_dir"),
        "duration_s": trial.user_attrs.get("duration_s"),
        "error": trial.user_attrs.get("error"),
    }


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive lock on `lock_path` (flock) among this machine's workers."""
    try:
        import fcntl
    except ImportError:  # not POSIX: each write is still whole, only their order is not kept
        yield
        return
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_results(study, sweep: Sweep, study_dir: Path, storage_spec: str, target: int) -> dict:
    """Write the study as JSON, read from the storage now; returns it.

    Every trial, counts by state, the best trial (complete trials only), and `final`: no trial was
    running, so every trial has its result. Workers sharing the study take turns (a lock file), and
    each reads the storage only once it has its turn, so the last write holds the latest state:
    whichever worker finishes last leaves the final file.
    """
    study_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(study_dir / ".results.lock"):
        results = collect_results(study, sweep, storage_spec, target)
        path = study_dir / RESULTS_FILE
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(results, indent=2) + "\n")
        os.replace(tmp, path)
    return results


def collect_results(study, sweep: Sweep, storage_spec: str, target: int) -> dict:
    optuna = _optuna()
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = None
    if complete:
        best_trial = study.best_trial
        best = trial_record(best_trial) | {"params": best_trial.user_attrs.get("args", {})}
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    return {
        "study_name": study.study_name,
        "storage": hide_password(storage_spec),
        "sweep": str(sweep.path),
        "program": sweep.program,  # what the trials ran (--program, else the sweep's), for search.seeds
        "config_file": (launcher_config_file(sweep.command) or (None, None))[1],
        "metric": sweep.metric,
        "goal": sweep.goal,
        "n_trials": target,
        "final": "running" not in counts,
        "counts": counts,
        "best": best,
        "trials": [trial_record(t) for t in trials],
    }


def have_matplotlib(what: str) -> bool:
    """Whether matplotlib can be imported (the pictures are optional); if not, one line says what is not drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"{what} not drawn: matplotlib is not installed (pip install matplotlib)", flush=True)
        return False
    return True


def draw_study(study, study_dir: Path, metric: str) -> list[Path]:
    """The optimization history and the parameter importances as pictures beside results.json (Optuna's
    matplotlib plots); returns the files written. Importances need two complete trials and two parameters
    that vary among them (one alone has all the importance): otherwise one line says why there is no picture.
    Without matplotlib, or when drawing fails, one line too; the search's outcome stays what it is."""
    if not have_matplotlib("the search's pictures"):
        return []
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")  # files only, no window; a program that embeds the runner keeps its own backend
    import warnings

    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    from common.curves import save_figure

    optuna = _optuna()
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not complete:
        print("the search's pictures not drawn: no complete trial yet", flush=True)
        return []
    names = sorted({name for trial in complete for name in trial.params})
    varying = [name for name in names if len({repr(trial.params.get(name)) for trial in complete}) > 1]
    pictures = [(HISTORY_FILE, lambda: plots.plot_optimization_history(study, target_name=metric))]
    if len(complete) >= 2 and len(varying) >= 2:
        pictures.append((IMPORTANCES_FILE, lambda: plots.plot_param_importances(study, params=varying,
                                                                               target_name=metric)))
    else:
        print(f"{IMPORTANCES_FILE} not drawn: parameter importances need 2 complete trials and 2 parameters that "
              f"vary among them (here {len(complete)} complete, varying: {', '.join(varying) or 'none'})", flush=True)
    written = []
    for name, plot in pictures:
        try:
            # Optuna's plots switch matplotlib's global style to ggplot: while they draw, not for the program's next one
            with warnings.catch_warnings(), matplotlib.rc_context():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental, at every call
                axes = plot()
                try:
                    annotate(axes, name, len(complete))
                    axes.figure.set_size_inches(8, 5)
                    axes.figure.tight_layout()
                    save_figure(axes.figure, study_dir / name)
                finally:
                    plt.close(axes.figure)
        except Exception as error:
            print(f"warning: {name} could not be drawn ({type(error).__name__}: {error})", file=sys.stderr, flush=True)
            continue
        written.append(study_dir / name)
    if written:
        print("pictures: " + ", ".join(str(path) for path in written), flush=True)
    return written


FEW_TRIALS = 20  # complete trials below which parameter importances are mostly noise (a forest fit to that few)


def annotate(axes, name: str, complete: int) -> None:
    """What Optuna's plots leave out: the history's trials are whole numbers (ticks at 0.5 mislead); importances
    say how many complete trials they come from, and that so few make them noise."""
    from matplotlib.ticker import MaxNLocator

    if name == HISTORY_FILE:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    elif name == IMPORTANCES_FILE:
        note = f"from {complete} complete trials" + (": importances from so few trials are noise"
                                                     if complete < FEW_TRIALS else "")
        axes.figure.text(0.01, 0.01, note, fontsize="small", color="darkred" if complete < FEW_TRIALS else "0.3")


def format_table(results: dict, sweep: Sweep) -> str:
    rows = [("#", "state", results["metric"], "evals", "time", "parameters")]
    for t in results["trials"]:
        value = t["value"] if t["value"] is not None else t["last_eval"]
        rows.append((
            str(t["number"]), t["state"], "" if value is None else f"{value:.6g}", str(t["evals"]),
            "" if t["duration_s"] is None else f"{t['duration_s']:.0f}s",
            short(effective_values(t["args"], t["extra_args"]), sweep) + (f"  [{t['error']}]" if t["error"] else ""),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths)) + "  " + row[5] for row in rows]
    counts = ", ".join(f"{n} {state}" for state, n in sorted(results["counts"].items()))
    lines.append(f"{len(results['trials'])} trials: {counts}")
    best = results["best"]
    if best:
        lines.append(f"best: trial {best['number']}, {results['metric']} = {best['value']:.6g} ({results['goal']}), "
                     f"output {best['output_dir']}")
        lines.append("best parameters: " + shlex.join(best["effective_args"]))  # as it ran, options after -- included
        replaced = overridden_args(best["params"], best["extra_args"])
        if replaced:
            lines.append(f"(the options after -- replaced the sweep's {shlex.join(replaced)})")
    else:
        lines.append("no complete trial yet")
    return "\n".join(lines)


@with_exit_codes
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, extra = split_passthrough(argv)
    cfg = parse_runner_config(SearchConfig, own, "python -m search --sweep ...", SYNOPSIS)
    return search(cfg, extra)

