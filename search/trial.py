"""Run one training job as a subprocess, follow its metrics as they are logged, stop it cleanly.

A job is whatever the sweep's command starts, usually `accelerate launch ... template.py`, which
may itself start several ranks. It runs in its own session (process group), so stopping it
signals every process it started: SIGTERM to the group, then SIGKILL to whatever is left after
a grace period. The group is also cleared after a normal exit, so no rank outlives its trial.

Metrics arrive through `<output_dir>/metrics.jsonl` (common.tracking writes one JSON object per
line, main process only); each line that holds the watched metric is one evaluation.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from common.errors import read_status

METRICS_FILE = "metrics.jsonl"  # common.curves.METRICS_FILE: the one name the tracker and the runner share
LOG_FILE = "trial.log"
_LAUNCHER_ERRORS = ("CalledProcessError", "ChildFailedError", "SignalException")


@dataclass
class TrialResult:
    state: str  # "complete", "stopped" (asked to stop, e.g. pruned) or "failed"
    evals: list[tuple[int, float]] = field(default_factory=list)  # (training step, value) per evaluation
    returncode: int | None = None
    error: str | None = None  # one line: why it failed
    missing_metric: bool = False  # it finished without ever logging the metric
    logged_keys: list[str] = field(default_factory=list)  # every metric name it did log
    duration_s: float = 0.0

    @property
    def value(self) -> float | None:
        return self.evals[-1][1] if self.evals else None


class MetricsTail:
    """Reads the lines appended to metrics.jsonl since the last call; a half-written line waits."""

    def __init__(self, path: Path, metric: str):
        self.path, self.metric = path, metric
        self.offset, self.pending = 0, b""
        self.keys: set[str] = set()

    def read(self) -> list[tuple[int, float]]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()  # empty after a complete line
        found = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            self.keys.update(k for k in record if k not in ("step", "time"))
            if self.metric in record:
                value = record[self.metric]  # tracking writes non-finite values as null
                value = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
                found.append((int(record.get("step", len(found))), value))
        return found


def trial_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment, with the running interpreter's bin folder first on PATH.

    `${env}` is /usr/bin/env and `${interpreter}` is `python`, as under `wandb agent`, so the
    command must find the virtual environment's `accelerate` and `python` also when it was not activated.
    """
    env = dict(os.environ)
    bin_dir = os.path.dirname(sys.executable)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the runner dies without cleaning up (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_trial(
    argv: list[str],
    output_dir: Path,
    metric: str,
    *,
    report: Callable[[int, int, float], None] = lambda index, step, value: None,
    should_stop: Callable[[], bool] = lambda: False,
    tick: Callable[[], None] = lambda: None,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout_s: float = 0.0,
    grace_s: float = 10.0,
    poll_s: float = 0.25,
) -> TrialResult:
    """Run `argv` to its end (or until `should_stop()` says so after a report) and return what happened.

    `report(index, step, value)` is called for each evaluation as it appears (index counts from 1);
    `should_stop()` is asked after new reports while the job runs; `tick()` is called every poll
    (for heartbeats). A job that has ended on its own by the time `should_stop()` answers yes is
    not stopped: it ran to its end, and its exit code decides its state as usual. Output goes to
    `<output_dir>/trial.log`. The whole process group is gone when this returns, also when it is
    interrupted (KeyboardInterrupt) or raises.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    tail = MetricsTail(output_dir / METRICS_FILE, metric)
    result = TrialResult(state="failed")
    started = time.monotonic()
    log_path = output_dir / LOG_FILE
    with log_path.open("ab") as log:
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env or trial_env(),
                cwd=cwd, start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        except OSError as error:
            result.error = f"cannot start {argv[0]}: {error.strerror or error}"
            return result
        try:
            stopping = False
            while True:
                returncode = proc.poll()
                new = tail.read()
                for step, value in new:
                    result.evals.append((step, value))
                    report(len(result.evals), step, value)
                if returncode is not None:
                    break
                if new and should_stop():
                    if proc.poll() is None:
                        stopping = True
                        break
                    continue  # it ended on its own while the answer came: read its end, do not stop it
                if timeout_s and time.monotonic() - started > timeout_s:
                    result.error = f"timed out after {timeout_s:g} s"
                    break
                tick()
                time.sleep(poll_s)
        finally:
            stop_group(proc, grace_s)  # also after a normal exit: nothing the job started may outlive it
    result.duration_s = time.monotonic() - started
    result.returncode = proc.returncode
    result.logged_keys = sorted(tail.keys)
    # The template's own record of how it ended (status.json) decides, not the launcher's exit code:
    # `accelerate launch` reports every failure as 1 and SIGTERM as 143, and a run that finished and
    # exported is finished even if a process of it then dies on the way out. Without a record (a
    # program that writes none, or one that never started) the exit code decides.
    status = read_status(output_dir) if not stopping and result.error is None else None
    finished = status["state"] == "finished" if status else proc.returncode == 0
    if stopping:
        result.state = "stopped"
    elif result.error is None and finished:
        result.state = "complete"
        result.missing_metric = not result.evals
        if result.missing_metric:
            result.state = "failed"
            result.error = f"finished without logging {metric}"
    elif result.error is None and status and status["state"] != "running":
        reason = status.get("error") or status.get("reason") or ""
        result.error = f"{status['state']} at step {status.get('step')} (exit {status.get('exit_code')})" + (
            f": {reason}" if reason else "")
    elif result.error is None:
        line = last_error_line(log_path)
        code = f"exit {proc.returncode}" if proc.returncode >= 0 else f"killed by {_signal_name(-proc.returncode)}"
        if status:  # still "running": a process of it was killed before it could record anything
            code = f"crashed at step {status.get('step')} ({code})"
        result.error = f"{code}: {line}" if line else code
    return result


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the job's process group, SIGKILL what is left after `grace_s`, wait until it is empty."""
    pgid = proc.pid  # start_new_session: the launcher leads its own group
    if not _group_alive(pgid, proc):
        return
    _killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_alive(pgid, proc):
            return
        time.sleep(0.05)
    _killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _group_alive(pgid, proc) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_alive(pgid: int, proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the leader, or it stays in the group as a zombie
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _has_live_member(pgid)


def _has_live_member(pgid: int) -> bool:
    """True if a process of the group is running; zombies (exited, not yet reaped by init) do not count."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        return True
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def last_error_line(log_path: Path, max_bytes: int = 65536) -> str:
    """The line that best says why a job failed: the last `error: ...` line, else the last exception line
    that is not the launcher's own report, else the last line."""
    try:
        with log_path.open("rb") as handle:
            handle.seek(max(0, log_path.stat().st_size - max_bytes))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in re.split(r"[\r\n]+", text) if line.strip()]
    for line in reversed(lines):
        if line.startswith("error: "):
            return line
    exception = re.compile(r"^(?:\[rank\d+\]: )?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)|[\w.]*Error)\b(: .*)?$")
    for line in reversed(lines):
        match = exception.match(line)
        if match and not any(name in match.group(1) for name in _LAUNCHER_ERRORS):
            return line
    return lines[-1] if lines else ""
