"""Metrics go to W&B (main process only) and to `<output_dir>/metrics.jsonl`; progress to tqdm."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from accelerate import Accelerator
from tqdm.auto import tqdm

from common.errors import EXIT_PREEMPTED, UsageError, at_failure

TRACKERS = ("wandb", "none")
METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"
END_STATES = {"finished": 0, "stopped": 0, "preempted": EXIT_PREEMPTED}


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
        if kind not in TRACKERS:
            raise UsageError(f"tracker must be one of {', '.join(TRACKERS)}, got {kind!r}")
        self.enabled = accelerator.is_main_process
        self.output_dir = Path(output_dir)
        self.metrics_path = self.output_dir / METRICS_FILE
        self.run = None
        self.offline = False
        self.started = time.time()
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        if kind == "wandb":
            self.run = self._start_wandb(project, config)

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
        return wandb.init(project=project, config=config, dir=str(self.output_dir), mode=mode, **kwargs)

    def _truncate_after(self, step: int) -> None:
        if not self.metrics_path.is_file():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except ValueError:
                continue  # a line cut short by a crash
        tmp = self.metrics_path.with_name(f".{METRICS_FILE}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.metrics_path)

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

    def summary(self, values: dict[str, float]) -> None:
        if self.run is not None:
            self.run.summary.update(values)

    def finish(self, requeue: bool = False, exit_code: int = 0) -> None:
        """End the W&B run. `requeue`: a preempted sweep run; W&B gives it to an agent again, same id.

        W&B requeues a run that is marked preempting and ends with a non-zero exit code; one that
        ends with 0 is finished. The code is passed here because W&B would otherwise record 0.
        """
        if self.run is None:
            return
        run_dir = Path(self.run.dir).parent
        if requeue:
            self.run.mark_preempting()
        self.run.finish(exit_code=exit_code)
        self.run = None
        if self.offline:
            print(f"W&B run saved offline; upload it with: wandb sync {run_dir}")


class RunStatus:
    """`<output_dir>/status.json`: how the run stands, for job scripts and search runners.

    Launchers do not pass exit codes on (`accelerate launch` turns every failure into 1, a SIGTERM it
    receives into 143), so the main process records the end state itself, atomically: "running" from
    the moment the run starts (after its settings were checked and its checkpoint loaded), then
    "finished", "stopped" (--stop_after_steps, or stopped for good by a sweep agent), "preempted"
    (checkpointed: requeue it) or "failed" (with the exit code and the error line). A reader that finds
    "running" after the job ended knows the run crashed (SIGKILL, OOM killer, a lost machine).
    With RUN_STATUS_FILE set, the same record is also written there (e.g. for a Slurm script).
    """

    def __init__(self, accelerator: Accelerator, output_dir: str | os.PathLike, progress):
        self.enabled = accelerator.is_main_process
        self.paths = [Path(output_dir) / STATUS_FILE] + ([Path(os.environ["RUN_STATUS_FILE"])]
                                                          if os.environ.get("RUN_STATUS_FILE") else [])
        self.progress = progress  # read at each write: the step the run had reached
        self.ended = False
        self._write("running")
        at_failure(self.failed)  # every error that ends main() records itself here

    def end(self, state: str, reason: str = "") -> None:
        """Record a normal end: finished, stopped or preempted."""
        self._write(state, exit_code=END_STATES[state], reason=reason)
        self.ended = True

    def failed(self, exit_code: int, message: str) -> None:
        if not self.ended:
            self.ended = True
            self._write("failed", exit_code=exit_code, error=message)

    def _write(self, state: str, **fields) -> None:
        if not self.enabled:
            return
        record = {"state": state, "step": self.progress.step, **fields, "host": socket.gethostname(),
                  "pid": os.getpid(), "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        for path in self.paths:
            tmp = path.with_name(f".{path.name}.tmp")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with tmp.open("w") as handle:
                    handle.write(json.dumps(record) + "\n")
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, path)
            except OSError:  # a full disk must not hide the error being reported; readers then see "running"
                tmp.unlink(missing_ok=True)


def read_status(output_dir: str | os.PathLike) -> dict | None:
    """The status record of a run folder, or None when there is none (or it is unreadable)."""
    try:
        record = json.loads((Path(output_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def progress_bar(accelerator: Accelerator, total: int, initial: int = 0, desc: str = "train") -> tqdm:
    """A tqdm bar on the main process only; the other ranks get a disabled one with the same API."""
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, disable=not accelerator.is_main_process)
