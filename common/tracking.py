"""Metrics go to W&B (main process only) and to `<output_dir>/metrics.jsonl`; progress to tqdm."""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import re
import sys
import time
import uuid
from pathlib import Path

from accelerate import Accelerator
from tqdm.auto import tqdm

from common.errors import UsageError, read_status

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # text the model wrote at each evaluation (the fine-tuning template)


def wandb_has_credentials() -> bool:
    """An API key in the environment or in ~/.netrc (what `wandb login` writes), found as wandb finds it."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc

        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
        # The file wandb reads ($NETRC first), named explicitly as wandb does: netrc.netrc() without a
        # path refuses a ~/.netrc that others can read, which wandb accepts, and the run went offline.
        path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
        return netrc.netrc(path).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def sweep_run_dir(output_dir: str) -> str:
    """`<output_dir>/<sweep id>/<run id>` in a run that `wandb agent` started, else `output_dir` itself.

    The agent starts every run of a sweep with the same command, so without this all of them would
    share one folder and each would resume the one before. It sets WANDB_SWEEP_ID and WANDB_RUN_ID
    for the command (every rank inherits them), and a run it requeues after a preemption keeps its
    id: it finds its own folder and resumes there.
    """
    sweep, run = os.environ.get("WANDB_SWEEP_ID"), os.environ.get("WANDB_RUN_ID")
    if not (sweep and run):
        return output_dir
    for name, value in (("WANDB_SWEEP_ID", sweep), ("WANDB_RUN_ID", run)):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", value) or set(value) == {"."}:
            raise UsageError(f"{name}={value!r} cannot name a folder; W&B ids are letters, digits, - and _")
    return os.path.join(output_dir, sweep, run)


class Tracker:
    """Log metrics once, from the main process, to every configured sink.

    `metrics.jsonl` is always written: it is what the local search runner reads while a trial
    runs, and it survives without any account. On resume, lines after the resumed step are
    dropped so the file matches the restored state.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        output_dir: str | os.PathLike,
        *,
        kind: str,
        project: str,
        config: dict,
        resume_step: int = 0,
    ):
        self.enabled = accelerator.is_main_process
        self.output_dir = Path(output_dir)
        self.metrics_path = self.output_dir / METRICS_FILE
        self.samples_path = self.output_dir / SAMPLES_FILE
        self.run = None
        self.offline = False
        self.started = time.time()
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        for path in (self.metrics_path, self.samples_path):
            self._truncate_after(path, resume_step)
        if kind == "wandb":
            self.run = self._start_wandb(project, config)

    @classmethod
    def for_run(cls, accelerator: Accelerator, cfg, resume_step: int = 0) -> Tracker:
        """The tracker a template's options ask for: their output_dir, tracker and wandb_project; all of them to W&B."""
        return cls(accelerator, cfg.output_dir, kind=cfg.tracker, project=cfg.wandb_project,
                   config=dataclasses.asdict(cfg), resume_step=resume_step)

    def _start_wandb(self, project: str, config: dict):
        import wandb

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
        # quiet: no 20-line history and summary at the end (metrics.jsonl and the run page have them), and
        # one sync hint (ours, below) instead of two. The run's .wandb file is flushed every second (W&B's
        # default is 15 s): `accelerate launch` answers a Ctrl-C or SIGTERM by terminating every process the
        # run started, W&B's service too, which then writes nothing more, so at most the last second is lost.
        run = wandb.init(project=project, config=config, dir=str(self.output_dir), mode=mode,
                         settings=wandb.Settings(quiet=True, x_transaction_log_flush_interval=1.0), **kwargs)
        atexit.register(self._finish_at_exit)  # runs before W&B's own exit hook (atexit runs the last one first)
        return run

    def _finish_at_exit(self) -> None:
        """A run that ended in an error or Ctrl-C: end the W&B run as failed with the run's exit code (status.json
        has it), quietly, so that the run's own `error:` line stays the last one on stderr (W&B's exit hook would
        add a traceback if its service is gone)."""
        if self.run is not None:
            status = read_status(self.output_dir) or {}
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
        if self.run is not None:
            self.run.log(metrics, step=step)

    def log_samples(self, rows: list[dict[str, str]], step: int) -> None:
        """Text a model wrote (one dict a sample, the same keys in each): `samples.jsonl` (main process), and a
        W&B table where W&B is on."""
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

    def finish(self, requeue: bool = False, exit_code: int = 0, quiet: bool = False) -> None:
        """End the W&B run. `requeue`: a preempted sweep run; W&B gives it to an agent again, same id.

        W&B requeues a run that is marked preempting and ends with a non-zero exit code; one that
        ends with 0 is finished. The code is passed here because W&B would otherwise record 0.
        `quiet`: no warning if W&B's service is gone (the run is ending with an error line of its own).
        """
        if self.run is None:
            return
        atexit.unregister(self._finish_at_exit)
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


def say(accelerator: Accelerator, text: str) -> None:
    """Print on the main process through tqdm, so a live progress bar is redrawn below the line, not glued to it."""
    if accelerator.is_main_process:
        tqdm.write(text)


def progress_bar(accelerator: Accelerator, total: int, initial: int = 0, desc: str = "train") -> tqdm:
    """A tqdm bar on the main process only; the other ranks get a disabled one with the same API."""
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, disable=not accelerator.is_main_process)
