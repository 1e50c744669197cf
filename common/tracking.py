"""Metrics go to `<output_dir>/metrics.jsonl` and to the trackers --tracker names (main process only); progress
to tqdm; at the end of a run, `<output_dir>/curves.png` (common/curves.py, where matplotlib is installed)."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import re
import shlex
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from common.config import tracker_names
from common.curves import CURVES_FILE, METRICS_FILE, draw_run_curves
from common.errors import UsageError, read_status

if TYPE_CHECKING:  # only a type here: importing accelerate loads torch
    from accelerate import Accelerator

SAMPLES_FILE = "samples.jsonl"  # text the model wrote at each evaluation (the fine-tuning template)
_mlflow_uri_set_here: str | None = None  # the MLflow store a Tracker of this process chose, not the user
MLFLOW_DB = "mlflow.db"  # the local MLflow store in the output folder, unless MLFLOW_TRACKING_URI is set


def wandb_has_credentials() -> bool:
    """An API key in the environment or in ~/.netrc (what `wandb login` writes), found as wandb finds it."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc

        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
        # The file wandb reads, named as wandb does: netrc.netrc() without a path refuses a ~/.netrc others can read
        path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
        return netrc.netrc(path).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def sweep_run_dir(output_dir: str) -> str:
    """`<output_dir>/<sweep id>/<run id>` in a run that `wandb agent` started (it sets both ids), else `output_dir`:
    the agent starts every run with the same command (each would resume the one before); a requeued run keeps its id."""
    sweep, run = os.environ.get("WANDB_SWEEP_ID"), os.environ.get("WANDB_RUN_ID")
    if not (sweep and run):
        return output_dir
    for name, value in (("WANDB_SWEEP_ID", sweep), ("WANDB_RUN_ID", run)):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", value) or set(value) == {"."}:
            raise UsageError(f"{name}={value!r} cannot name a folder; W&B ids are letters, digits, - and _")
    return os.path.join(output_dir, sweep, run)


class Tracker:
    """Log metrics once, from the main process, to `metrics.jsonl` (always: the local search runner reads it, and it
    needs no account; on resume, lines after the resumed step are dropped) and to the trackers `kind` names. Those are
    accelerate's tracker classes, built as `Accelerator.init_trackers` builds them and handed to the Accelerator
    (`accelerator.get_tracker(name)`), but started, logged to and finished here: the run ids and resumed step are known
    only after the Accelerator is built, and `end_training` cannot give W&B the exit code and a preemption mark."""

    def __init__(self, accelerator: Accelerator, output_dir: str | os.PathLike, *, kind: str, project: str,
                 config: dict, resume_step: int = 0):
        self.enabled = accelerator.is_main_process
        self.output_dir = Path(output_dir)
        self.metrics_path = self.output_dir / METRICS_FILE
        self.samples_path = self.output_dir / SAMPLES_FILE
        self.run = None  # the W&B run, where W&B is on
        self.trackers: list = []  # accelerate's GeneralTracker objects, started (main process only)
        self.offline = False
        self.wandb_service_pid: int | None = None  # W&B's service where this run started it (start_wandb_service_apart)
        self.started = time.time()
        self._handed_to: list | None = None  # the Accelerator's own list of trackers, which holds ours too
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        for path in (self.metrics_path, self.samples_path):
            self._truncate_after(path, resume_step)
        for name in tracker_names(kind):
            self.trackers.append(getattr(self, f"_start_{name}")(project, config, resume_step))
        if self.trackers:
            atexit.register(self._finish_at_exit)  # runs before the trackers' own exit hooks (last in, first out)
            if isinstance(getattr(accelerator, "trackers", None), list):
                self._handed_to = accelerator.trackers
                self._handed_to.extend(self.trackers)

    @classmethod
    def for_run(cls, accelerator: Accelerator, cfg, resume_step: int = 0) -> Tracker:
        """The tracker a template's options ask for (output_dir, tracker, wandb_project); all as its configuration."""
        return cls(accelerator, cfg.output_dir, kind=cfg.tracker, project=cfg.wandb_project,
                   config=dataclasses.asdict(cfg), resume_step=resume_step)

    @staticmethod
    def _started(tracker):
        """accelerate's `tracker`, started, and set to log and finish wherever it is called: this Tracker is the main
        process's alone already, and accelerate's own check would build a PartialState where there is none."""
        tracker.main_process_only = False
        tracker.start()
        return tracker

    def _start_wandb(self, project: str, config: dict, resume_step: int):
        import wandb
        from accelerate.tracking import WandBTracker

        # An explicit WANDB_MODE wins; otherwise online only when there are credentials to use.
        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_has_credentials() else "offline")
        self.offline = mode == "offline"
        run_id_file = self.output_dir / "wandb_run_id"
        kwargs = {}
        if "WANDB_SWEEP_ID" not in os.environ:
            # A resumed job keeps logging into the same W&B run; a sweep agent assigns its own id.
            run_id = run_id_file.read_text().strip() if run_id_file.is_file() else uuid.uuid4().hex[:8]
            run_id_file.write_text(run_id + "\n")
            kwargs = {"id": run_id, "resume": "allow"}
        self.wandb_service_pid = start_wandb_service_apart()  # None: W&B starts it, as its child
        # quiet: no history and summary at the end (metrics.jsonl has them), one sync hint (ours, in finish); the .wandb
        # file flushed every second (W&B: 15 s), should the service end first; the config goes in wandb.init, not after.
        try:
            tracker = self._started(WandBTracker(
                project, config=config, dir=str(self.output_dir), mode=mode,
                settings=wandb.Settings(quiet=True, x_transaction_log_flush_interval=1.0), **kwargs))
        finally:
            if self.wandb_service_pid:  # for this start only: a later run in this process gets a live one of its own
                os.environ.pop("WANDB_SERVICE", None)
        self.run = tracker.run
        # asyncio logs each write to a W&B service that is gone (a launcher ends it with the run at a Ctrl-C or
        # SIGTERM), after the run's own last line; what W&B lost, finish says.
        logging.getLogger("asyncio").addFilter(not_a_lost_service_write)
        return tracker

    def _start_tensorboard(self, project: str, config: dict, resume_step: int):
        from accelerate.tracking import TensorBoardTracker

        # event files in <output_dir>/tensorboard, those after a resumed step purged (each step once, as metrics.jsonl)
        tracker = self._started(TensorBoardTracker("tensorboard", str(self.output_dir), purge_step=resume_step + 1))
        if resume_step == 0:
            tracker.store_init_configuration(scalar_config(config))
        return tracker

    def _start_mlflow(self, project: str, config: dict, resume_step: int):
        import mlflow
        from accelerate.tracking import MLflowTracker

        global _mlflow_uri_set_here
        # set_tracking_uri exports MLFLOW_TRACKING_URI: a value this process set is not the user's choice of a store
        local = os.environ.get("MLFLOW_TRACKING_URI") in (None, "", _mlflow_uri_set_here)
        if local:  # a local store in the output folder: `mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db`
            _mlflow_uri_set_here = f"sqlite:///{self.output_dir.resolve() / MLFLOW_DB}"
            mlflow.set_tracking_uri(_mlflow_uri_set_here)
            for noisy in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..."
                logging.getLogger(noisy).setLevel(logging.WARNING)
        run_id_file = self.output_dir / "mlflow_run_id"
        run_id = run_id_file.read_text().strip() if run_id_file.is_file() else None  # a restart: the same run
        if run_id is not None and local:
            for table in ("metrics", "latest_metrics"):
                drop_steps_after(self.output_dir / MLFLOW_DB, table, "run_uuid", run_id, resume_step)
        tracker = self._started(MLflowTracker(
            experiment_name=project, logging_dir=str(self.output_dir.resolve() / "mlartifacts") if local else None,
            run_id=run_id, run_name=self.output_dir.name))
        run_id_file.write_text(tracker.active_run.info.run_id + "\n")
        if run_id is None:  # MLflow refuses a parameter logged again with another value (an option a resume changed)
            tracker.store_init_configuration(scalar_config(config))
        return tracker

    def _start_trackio(self, project: str, config: dict, resume_step: int):
        # trackio reads TRACKIO_DIR when imported: its SQLite store goes in the output folder unless one is set
        local = self.output_dir.resolve() / "trackio"
        os.environ.setdefault("TRACKIO_DIR", str(local))
        from accelerate.tracking import TrackioTracker

        name_file = self.output_dir / "trackio_run_name"
        # a name of its own (the store may be shared through TRACKIO_DIR), kept for the restarts, which resume it
        name = (name_file.read_text().strip() if name_file.is_file()
                else f"{self.output_dir.name}-{uuid.uuid4().hex[:8]}")
        name_file.write_text(name + "\n")
        if Path(os.environ["TRACKIO_DIR"]) == local:
            for database in local.glob("*.db"):  # one a project
                drop_steps_after(database, "metrics", "run_name", name, resume_step)
        return self._started(TrackioTracker(project, name=name, resume="allow", config=config))

    def _finish_at_exit(self) -> None:
        """A run that ended in an error or Ctrl-C: end the trackers' runs as failed with the run's exit code
        (status.json has it), quietly, so the run's own `error:` line stays the last one on stderr."""
        if self.trackers:
            status = read_status(self.output_dir) or {}
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # and what asyncio logs of W&B's service at exit
            self.finish(exit_code=status.get("exit_code") or 1, quiet=True)

    @staticmethod
    def _truncate_after(path: Path, step: int) -> None:
        if not path.is_file():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except ValueError:
                continue  # a line cut short by a crash
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": round(time.time() - self.started, 3)}
        record.update({k: (v if math.isfinite(v) else None) if isinstance(v, float) else v for k, v in metrics.items()})
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
        # numbers to every tracker; W&B takes the rest too (tensorboard would keep text as text, mlflow drops it)
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        for tracker in self.trackers:
            tracker.log(metrics if tracker.name == "wandb" else numbers, step=step)

    def log_once(self, metrics: dict[str, float], step: int) -> None:
        """`log`, unless metrics.jsonl holds `step` already: a session before a restart logged it."""
        if self.enabled and f'"step": {step},' not in (self.metrics_path.read_text()
                                                      if self.metrics_path.is_file() else ""):
            self.log(metrics, step)

    def log_samples(self, rows: list[dict[str, str]], step: int) -> None:
        """Text a model wrote (a dict a sample, same keys in each) to `samples.jsonl` and, with W&B on, a W&B table."""
        if not self.enabled or not rows:
            return
        with self.samples_path.open("a") as handle:
            handle.write("".join(json.dumps({"step": step, **row}) + "\n" for row in rows))
        if self.run is not None:
            import wandb

            columns = list(rows[0])
            table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
            self.run.log({"val/samples": table}, step=step)

    def summary(self, values: dict[str, float]) -> None:
        if self.run is not None:
            self.run.summary.update(values)

    def draw_curves(self) -> None:
        """`curves.png` from the whole metrics.jsonl: without matplotlib one line says how to get it; a failure to
        draw is one warning, never the run's failure. CURVES_PNG=0 skips it (many short trials, the test suite)."""
        if os.environ.get("CURVES_PNG") == "0":
            return
        # matplotlib's first import on a machine says on stderr that it builds its font cache: not news about the run
        quiet = logging.getLogger("matplotlib")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            try:
                import matplotlib  # noqa: F401  (optional: a template runs without it)
            except ImportError:
                print(f"{CURVES_FILE} not drawn: matplotlib is not installed; pip install matplotlib, then "
                      f"python scripts/plot_runs.py {self.output_dir}", flush=True)
                return
            draw_run_curves(self.output_dir)
        except Exception as error:
            print(f"warning: {CURVES_FILE} could not be drawn ({type(error).__name__}: {error}); "
                  f"the values are in {self.metrics_path}", file=sys.stderr, flush=True)
        finally:
            quiet.setLevel(level)

    def finish(self, requeue: bool = False, exit_code: int = 0, quiet: bool = False) -> None:
        """Draw curves.png (main process), end each tracker's run and take it off the Accelerator's list (lest
        `end_training` end it again). `requeue`: a preempted sweep run, marked preempting, which W&B requeues (same
        id) when `exit_code` is not 0. `quiet`: the run ends with an error line of its own: no picture, no warning."""
        if self.enabled and not quiet:
            self.draw_curves()
        if not self.trackers:
            return
        atexit.unregister(self._finish_at_exit)
        for tracker in self.trackers:
            if self._handed_to is not None and tracker in self._handed_to:
                self._handed_to.remove(tracker)
            if tracker.name == "wandb":
                self._finish_wandb(requeue, exit_code, quiet)
                continue
            try:
                if tracker.name == "mlflow" and exit_code:
                    import mlflow

                    mlflow.end_run(status="KILLED")  # accelerate's finish would record a finished run
                elif tracker.name == "trackio":
                    import trackio

                    # also forgets the current run, which trackio's exit hook would finish again, after the last line
                    said = io.StringIO()
                    with contextlib.redirect_stdout(said):
                        trackio.finish()
                    # not its "Uploading logs to Trackio" line: the store is a local file; where it is, instead
                    print("".join(line for line in said.getvalue().splitlines(keepends=True)
                                  if not line.startswith("* Run finished. Uploading logs to Trackio ")), end="")
                    store = shlex.quote(os.environ["TRACKIO_DIR"])  # set when it started
                    print(f"trackio run saved in {store}; view it with: TRACKIO_DIR={store} trackio show "
                          f"--project {shlex.quote(tracker.run_name)}", flush=True)
                else:
                    tracker.finish()
            except Exception as error:
                if not quiet:
                    print(f"warning: {tracker.name} could not finish the run ({type(error).__name__}: {error})",
                          file=sys.stderr, flush=True)
        self.trackers = []

    def _finish_wandb(self, requeue: bool, exit_code: int, quiet: bool) -> None:
        run_dir = Path(self.run.dir).parent
        try:
            if requeue:
                self.run.mark_preempting()
            self.run.finish(exit_code=exit_code)
        except Exception as error:  # W&B's service process is gone: a SIGTERM to the process tree reaches it too
            if not quiet:
                print(f"warning: W&B could not finish the run ({type(error).__name__}: {error}); what it recorded is "
                      f"in {run_dir}", file=sys.stderr, flush=True)
            try:
                import wandb

                wandb.teardown()  # drops W&B's exit hook, which would print the same failure as a traceback at exit
            except Exception:
                pass
        self.run = None
        if self.offline:
            print(f"W&B run saved offline; upload it with: wandb sync {run_dir}")


def start_wandb_service_apart(timeout_s: float = 30.0) -> int | None:
    """Start W&B's service outside this process's tree, for wandb.init (through WANDB_SERVICE); its pid, or None
    where W&B's internals differ (W&B then starts it as its child). `accelerate launch` ends every descendant of the
    training process at once at a Ctrl-C or SIGTERM: a child service would die before the run ends its W&B run."""
    if os.environ.get("WANDB_SERVICE") or not hasattr(os, "fork"):
        return None  # a service of the parent's (`wandb agent`'s); or Windows, where no tree is terminated
    try:
        from wandb.sdk import wandb_init
        from wandb.sdk.lib.service import service_port_file
        from wandb.util import get_core_path

        with tempfile.TemporaryDirectory() as folder:
            port_file = Path(folder) / "port"
            # by a shell that exits at once (own session); detached: ends 5 s after its last client, not with the shell
            core = [get_core_path(), "--port-filename", str(port_file), "--detached", "--idle-timeout", "5s"]
            shell = subprocess.run(["sh", "-c", '"$@" </dev/null >/dev/null 2>&1 & echo $!', "sh", *core], check=True,
                                   start_new_session=True, timeout=timeout_s, capture_output=True, text=True)
            deadline = time.monotonic() + timeout_s
            while (token := service_port_file._poll_once(port_file)) is None and time.monotonic() < deadline:
                time.sleep(0.05)
        if token is None:
            return None
        token.save_to_env()
        wandb_init._shared_service_notice_shown = True  # else W&B says it uses "an existing" service: this one
        return int(shell.stdout)
    except Exception:  # noqa: BLE001  (W&B's internals of another version: W&B starts its service itself)
        return None


def not_a_lost_service_write(record: logging.LogRecord) -> bool:
    """A logging filter: False for asyncio's line about a write to a connection that is gone."""
    return record.getMessage() != "socket.send() raised exception."


def drop_steps_after(database: Path, table: str, run_column: str, run: str, step: int) -> None:
    """Delete a run's values after `step` (a resume logs them again) from a local SQLite store (MLflow's, trackio's)
    by editing its table, as neither has a call for it; a store without that table or column is left alone."""
    import sqlite3

    if not database.is_file():
        return
    try:
        with contextlib.closing(sqlite3.connect(database)) as connection, connection:
            connection.execute(f"DELETE FROM {table} WHERE {run_column} = ? AND step > ?", (run, step))
    except sqlite3.OperationalError as error:
        print(f"warning: steps after {step} not removed from {database} ({error}): a reader may show them twice",
              file=sys.stderr, flush=True)


def scalar_config(config: dict) -> dict:
    """The run's configuration as the values tensorboard's hparams and MLflow's params take: numbers, text and
    booleans as they are, anything else (lists, None) as its text."""
    return {key: value if isinstance(value, (bool, int, float, str)) else str(value) for key, value in config.items()}


def say(accelerator: Accelerator, text: str) -> None:
    """Print on the main process through tqdm, so a live progress bar is redrawn below the line, not glued to it;
    through accelerate's pipe where the bar goes that way (straight to stdout it would overtake the bar's clearing)."""
    if accelerator.is_main_process:
        tqdm.write(text, file=sys.stderr if terminal_behind_a_pipe() else None)


def terminal_behind_a_pipe() -> bool:
    """accelerate's launcher of one process reads our stderr through a pipe (to repeat its tail after a failure) and
    writes it to its own: there a terminal shows on stdout only, which the launcher leaves us."""
    return sys.stdout.isatty() and stat.S_ISFIFO(os.fstat(sys.stderr.fileno()).st_mode)


class LinesOnly:
    """The bar's stream when it is not a terminal (a job's log file): each refresh a line of its own, and nothing of
    the carriage returns and blanks that redraw it in place, which a file keeps as fragments glued to the next line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        if line := text.replace("\r", "").rstrip():
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(accelerator: Accelerator, total: int, initial: int = 0, desc: str = "train") -> tqdm:
    """A tqdm bar on the main process only (a disabled one elsewhere). Where stderr is not a terminal it writes a
    line where it would redraw itself (each logged loss, every 30-60 s: `LinesOnly`); where stdout is not one, it
    is line-buffered, so its lines land in a log file in order among the bar's."""
    if not sys.stdout.isatty() and hasattr(sys.stdout, "reconfigure"):  # (a notebook's stream has none)
        sys.stdout.reconfigure(line_buffering=True)
    terminal = sys.stderr.isatty() or terminal_behind_a_pipe()
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, mininterval=0.1 if terminal else 30,
                maxinterval=10 if terminal else 60,  # the interval of tqdm's own refresh of a bar in a slow stretch
                file=sys.stderr if terminal else LinesOnly(sys.stderr), disable=not accelerator.is_main_process)
