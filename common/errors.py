"""How a run ends: errors a user can act on as one `error:` line and a documented exit code (never a traceback
wall), and `<output_dir>/status.json`, the end state that survives any launcher."""

from __future__ import annotations

import atexit
import errno
import functools
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, TypeVar

# Exit codes the templates document (README, "Exit codes").
EXIT_USAGE = 2  # bad config, CLI value, data path, checkpoint or sweep file
EXIT_NON_FINITE = 3  # the loss or the gradients became NaN/inf; the last good checkpoint is kept
EXIT_SAVE_FAILED = 4  # a checkpoint or the export could not be written (e.g. disk full); earlier checkpoints are intact
EXIT_RANK_LOST = 5  # another rank died or did not answer within --timeout_s; the last complete checkpoint is kept
EXIT_PREEMPTED = 75  # stopped by SIGTERM/SIGUSR1 after saving a checkpoint: requeue and resume (EX_TEMPFAIL)
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), as shells report it; the checkpoints saved before are intact
SILENT_RANK_GRACE_S = 15.0  # how long a rank that prints no error line waits to exit (_leave_the_line_to_local_rank_0)

F = TypeVar("F", bound=Callable[..., object])

# RunStatus's hooks (see at_failure), set once the run started.
_failure_hook: Callable[[int, str], None] | None = None
_stop_hook: Callable[[str, str], None] | None = None


def at_failure(hook: Callable[[int, str], None] | None, stopped: Callable[[str, str], None] | None = None) -> None:
    """Have `hook(exit_code, message)` called when the wrapped main() fails, and `stopped(state, reason)` when it
    ends for a StoppedBeforeTraining (one pair: the current run's)."""
    global _failure_hook, _stop_hook
    _failure_hook, _stop_hook = hook, stopped


class UsageError(Exception):
    """Something the user passed is wrong; the message names it and says what to do."""


class NonFiniteError(Exception):
    """Training produced NaN or inf; the message names the step."""


class SaveError(OSError):
    """Writing a checkpoint or the export failed (disk full, ...); the message names it and says what is kept."""


class StoppedBeforeTraining(KeyboardInterrupt):
    """A stop signal before the session's first optimizer step, raised by PreemptionWatcher's handler wherever the
    run then is: nothing to save yet, and a launcher kills a rank 5 s after passing a stop on, while the first step
    may be minutes away. A KeyboardInterrupt, which W&B and the DataLoader handle as a user's stop."""

    def __init__(self, state: str, reason: str):
        super().__init__(reason)
        self.state, self.reason = state, reason

    @property
    def exit_code(self) -> int:
        return END_STATES[self.state]


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Timed out waiting", "Broken pipe",
              "Connection refused")


def is_rank_lost(error: BaseException) -> bool:
    """True when a collective failed because another rank is gone or hung past the process-group timeout: torch's
    DistError (NCCL, the rendezvous store), or gloo's plain RuntimeError whose message says so."""
    dist = sys.modules.get("torch.distributed")  # never imported here: the search runner has no torch
    if dist is not None and isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and "gloo" in text and any(reason in text for reason in _PEER_GONE)


def one_line(error: BaseException) -> str:
    """The message of `error` as one line, also when a DataLoader worker wrapped it in a traceback."""
    text = str(error).strip()
    if "Original Traceback" in text:  # raised inside a loader worker: the real message is the last line
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return text.splitlines()[0] if text else type(error).__name__


def inner_errors(error: BaseException) -> list[BaseException]:
    """The exceptions inside a torch.distributed.checkpoint CheckpointException (one per failed rank)."""
    failures = getattr(error, "failures", None) or {}
    return [getattr(f, "exc", f) for f in failures.values() if isinstance(getattr(f, "exc", f), BaseException)]


def checkpoint_reason(error: BaseException) -> str:
    """One line saying why a checkpoint save or load failed, also for the errors torch.distributed.checkpoint wraps."""
    inner = inner_errors(error)
    error = inner[0] if inner else error
    if isinstance(error, RuntimeError) and str(error).startswith("Error(s) in loading state_dict"):
        return _state_dict_mismatch(str(error))
    return one_line(error)


_SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\(\[(.*?)\]\) from "
                            r"checkpoint, the shape in current model is torch\.Size\(\[(.*?)\]\)")


def _state_dict_mismatch(text: str, shown: int = 2) -> str:
    """torch's load_state_dict complaint (a line per problem) as one line: the first few keys (and shapes) of each."""
    sizes = [f"size mismatch for {m[1]}: checkpoint ({m[2]}), model ({m[3]})" for m in _SIZE_MISMATCH.finditer(text)]
    parts = sizes[:shown] + ([f"{len(sizes) - shown} more size mismatches"] if len(sizes) > shown else [])
    for kind, what in (("Missing", "model keys not in the checkpoint"), ("Unexpected", "keys the model lacks")):
        line = re.search(rf"{kind} key\(s\) in state_dict: (.*)", text)
        names = re.findall(r'"([^"]+)"', line[1]) if line else []
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        parts += [f"{what}: {', '.join(names[:shown])}{more}"] if names else []
    return "; ".join(parts) or text.splitlines()[0]


def is_first_local_process() -> bool:
    """True on local rank 0 (or when not launched distributed), so a message prints once per machine."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _close_progress_bars() -> None:
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def _peer_reason(error: BaseException) -> str:
    """gloo's message without its source location and advice: "Timed out waiting 15000ms for recv ..." """
    text = re.sub(r"^\[[^\]]*\]\s*", "", one_line(error))
    return text.split(". ")[0].rstrip(".")


def _record_failure(code: int, message: str) -> None:
    if _failure_hook is not None:
        _failure_hook(code, message)


def _release_process_group(release: Callable[[], None] | None, error: BaseException | None = None) -> None:
    """`release()` (common.accelerator.release_process_group), once the frames of `error`'s traceback, which keep
    main()'s model and so the group alive, are cleared. A Ctrl-C meanwhile is ignored: main() has ended, and a
    KeyboardInterrupt here would end a finished run in a traceback."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    if release is None:
        return
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if on_main_thread else None
    try:
        release()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _report(message: str, code: int, every_rank: bool = False) -> None:
    run_started = _failure_hook is not None
    _record_failure(code, message)
    _close_progress_bars()  # so the message starts on its own line, not after a half-drawn bar
    if every_rank or is_first_local_process():
        print(f"error: {message}", file=sys.stderr, flush=True)
    elif not run_started:
        _leave_the_line_to_local_rank_0()
    sys.exit(code)


def _leave_the_line_to_local_rank_0() -> None:
    """Bad input before the run starts fails every rank, and only local rank 0 prints the line the user gets. A
    launcher ends the job the moment one rank exits with an error, so this silent rank waits, lest rank 0, a moment
    behind, get the SIGTERM before its line is out; the launcher ends the wait once rank 0 has exited."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the run's preemption handler must not hold that SIGTERM off
    time.sleep(SILENT_RANK_GRACE_S)


def _out_of_memory(error: BaseException) -> str | None:
    """If `error` says memory (host or GPU) ran out: " allocating <size>", or "" when it does not say; else None."""
    torch = sys.modules.get("torch")  # never imported here: the search runner has no torch
    if not (isinstance(error, MemoryError) or (torch is not None and isinstance(error, torch.OutOfMemoryError))
            or (isinstance(error, RuntimeError) and "can't allocate memory" in str(error))):
        return None
    size = re.search(r"[Tt]ried to allocate ([\d.]+) ?(bytes|[KMGT]iB)", str(error))
    if size is None:
        return ""
    amount, unit = size.groups()
    return f" allocating {int(amount) / 2**30:,.1f} GiB" if unit == "bytes" else f" allocating {amount} {unit}"


def _stopped(stop: KeyboardInterrupt, interrupted: str) -> None:
    """Ctrl-C (exit 130 and its line), or a stop signal before the session's first step (StoppedBeforeTraining)."""
    if not isinstance(stop, StoppedBeforeTraining):
        _report("interrupted by Ctrl-C" + (f"; {interrupted}" if interrupted else ""), EXIT_INTERRUPTED)
    if _stop_hook is not None:
        _stop_hook(stop.state, stop.reason)
    _close_progress_bars()
    if is_first_local_process():
        print(f"stopped before its first step by {stop.reason}; nothing new to save, continue with --resume auto",
              file=sys.stderr if stop.exit_code else sys.stdout, flush=True)
    sys.exit(stop.exit_code)


def ignore_ctrl_c() -> None:
    """From the run's end (`end_run`: it is recorded) to main()'s return, and from the interpreter's exit: a Ctrl-C
    would only strike the teardown (loader workers being joined, exit handlers) in a traceback."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def with_exit_codes(main: F | None = None, *, interrupted: str = "", release: Callable[[], None] | None = None) -> F:
    """Run `main`; turn the errors a user can act on into `error: <message>` on stderr and an exit code. UsageError or
    running out of memory -> 2, NonFiniteError -> 3, SaveError or a full disk -> 4 (printed once per machine, as every
    rank raises them); a lost rank -> 5, printed by every rank that noticed, with its number; Ctrl-C -> 130, with
    `interrupted` (what to do next) after it: `@with_exit_codes(interrupted="...")`. After main() returns or exits, but
    not after a lost rank, `release()` runs (the templates: common.accelerator.release_process_group)."""
    if main is None:
        return functools.partial(with_exit_codes, interrupted=interrupted, release=release)  # type: ignore[return-value]

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        ctrl_c = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
        try:
            result = reported(*args, **kwargs)
        except SystemExit as error:  # ours below (already recorded), or a template's exit code
            if error.code not in (0, None):
                _record_failure(error.code if isinstance(error.code, int) else 1, str(error.code))
            if error.code != EXIT_RANK_LOST:  # a collective may still wait on the lost rank: joining could hang
                _release_process_group(release, error)
            raise
        except BaseException as error:  # a bug, or Ctrl-C: the traceback follows; the end state says failed
            _record_failure(130 if isinstance(error, KeyboardInterrupt) else 1, one_line(error))
            raise
        finally:
            at_failure(None)
            if ctrl_c is not None:  # a caller that goes on (a notebook) gets Ctrl-C back, until the interpreter exits
                signal.signal(signal.SIGINT, ctrl_c)
                atexit.unregister(ignore_ctrl_c)
                atexit.register(ignore_ctrl_c)  # the last registered: the first exit handler to run
        _release_process_group(release)
        return result

    def reported(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UsageError as error:
            _report(one_line(error), EXIT_USAGE)
        except NonFiniteError as error:
            _report(one_line(error), EXIT_NON_FINITE)
        except SaveError as error:
            _report(one_line(error), EXIT_SAVE_FAILED)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            where = f" writing {error.filename}" if error.filename else ""
            _report(f"disk full{where} ({error.strerror}); the checkpoints saved before are intact", EXIT_SAVE_FAILED)
        except KeyboardInterrupt as stop:
            _stopped(stop, interrupted)
        except (MemoryError, RuntimeError) as error:
            if isinstance(error.__cause__, KeyboardInterrupt):  # Python 3.11 wraps one that strikes as a class is
                _stopped(error.__cause__, interrupted)  # made (an import's dataclass: "Error calling __set_name__")
            if (memory := _out_of_memory(error)) is not None:
                _report(f"out of memory{memory}: lower --batch_size or the model's size", EXIT_USAGE)
            if not is_rank_lost(error):
                raise
            rank = os.environ.get("RANK", "0")
            _report(f"rank {rank}: another rank died or did not answer within --timeout_s ({_peer_reason(error)}); "
                    "the last complete checkpoint is kept: resume with --resume auto", EXIT_RANK_LOST, every_rank=True)

    return wrapper  # type: ignore[return-value]


STATUS_FILE = "status.json"
END_STATES = {"finished": 0, "stopped": 0, "preempted": EXIT_PREEMPTED}


class RunStatus:
    """`<output_dir>/status.json` (and $RUN_STATUS_FILE where set): how the run stands, for job scripts and search
    runners, as launchers do not pass exit codes on. Written atomically by the main process: "running" once the run
    started, with the step a resume would continue from (the start, then each complete checkpoint's), then "finished",
    "stopped", "preempted" or "failed" (README, "Errors and exit codes"); "running" after the job ended: a crash."""

    def __init__(self, accelerator, output_dir: str | os.PathLike, state, checkpoints=None):
        self.enabled = accelerator.is_main_process
        self.paths = [Path(output_dir) / STATUS_FILE] + ([Path(os.environ["RUN_STATUS_FILE"])]
                                                          if os.environ.get("RUN_STATUS_FILE") else [])
        self.state = state  # read at each end: the step the run had reached
        self.ended = False
        self._lock = threading.Lock()  # a checkpoint's update (writer thread) never overwrites the end state
        self._write("running")
        at_failure(self.failed, stopped=self.end)  # every error that ends main() records itself here
        if checkpoints is not None:
            checkpoints.on_published = self.checkpointed

    def checkpointed(self, step: int) -> None:
        """A checkpoint of `step` is complete: while the run is running, a resume would continue from there."""
        with self._lock:
            if not self.ended:
                self._write("running", step=step)

    def end(self, state: str, reason: str = "") -> None:
        """Record a normal end: finished, stopped or preempted."""
        with self._lock:
            self._write(state, exit_code=END_STATES[state], reason=reason)
            self.ended = True

    def failed(self, exit_code: int, message: str) -> None:
        with self._lock:
            if not self.ended:
                self.ended = True
                self._write("failed", exit_code=exit_code, error=message)

    def _write(self, state: str, step: int | None = None, **fields) -> None:
        if not self.enabled:
            return
        step = self.state.step if step is None else step
        record = {"state": state, "step": step, **fields, "host": socket.gethostname(),
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
