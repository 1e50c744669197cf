"""Bad input is reported as one line and a non-zero exit, never as a traceback wall."""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, TypeVar

# Exit codes the templates document (README, "Exit codes").
EXIT_USAGE = 2  # bad config, CLI value, data path, checkpoint or sweep file

F = TypeVar("F", bound=Callable[..., object])


class UsageError(Exception):
    """Something the user passed is wrong; the message names it and says what to do."""


def is_first_local_process() -> bool:
    """True on local rank 0 (or when not launched distributed), so a message prints once per machine."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def report_usage_errors(main: F) -> F:
    """Run `main`; turn a UsageError into `error: <message>` on stderr and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UsageError as error:
            if is_first_local_process():
                print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USAGE)

    return wrapper  # type: ignore[return-value]
