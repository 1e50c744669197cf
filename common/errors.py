"""Bad input is reported as one line and a non-zero exit, never as a traceback wall."""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, TypeVar

# Exit codes the templates document (README, "Exit codes").
EXIT_USAGE = 2  # bad config, CLI value, data path, checkpoint or sweep file
EXIT_NON_FINITE = 3  # the loss or the gradients became NaN/inf; the last good checkpoint is kept
EXIT_PREEMPTED = 75  # stopped by SIGTERM/SIGUSR1 after saving a checkpoint: requeue and resume (EX_TEMPFAIL)

F = TypeVar("F", bound=Callable[..., object])


class UsageError(Exception):
    """Something the user passed is wrong; the message names it and says what to do."""


class NonFiniteError(Exception):
    """Training produced NaN or inf; the message names the step."""


def one_line(error: BaseException) -> str:
    """The message of `error` as one line, also when a DataLoader worker wrapped it in a traceback."""
    text = str(error).strip()
    if "Original Traceback" in text:  # raised inside a loader worker: the real message is the last line
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return text.splitlines()[0] if text else type(error).__name__


def is_first_local_process() -> bool:
    """True on local rank 0 (or when not launched distributed), so a message prints once per machine."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _close_progress_bars() -> None:
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def report_usage_errors(main: F) -> F:
    """Run `main`; turn a UsageError or NonFiniteError into `error: <message>` on stderr and its exit code."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (UsageError, NonFiniteError) as error:
            _close_progress_bars()  # so the message starts on its own line, not after a half-drawn bar
            if is_first_local_process():
                print(f"error: {one_line(error)}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USAGE if isinstance(error, UsageError) else EXIT_NON_FINITE)

    return wrapper  # type: ignore[return-value]
