"""Errors a user can act on end as one `error:` line and a documented exit code, never as a traceback wall."""

from __future__ import annotations

import errno
import functools
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import TypeVar

# Exit codes the templates document (README, "Exit codes").
EXIT_USAGE = 2  # bad config, CLI value, data path, checkpoint or sweep file
EXIT_NON_FINITE = 3  # the loss or the gradients became NaN/inf; the last good checkpoint is kept
EXIT_SAVE_FAILED = 4  # a checkpoint or the export could not be written (e.g. disk full); earlier checkpoints are intact
EXIT_RANK_LOST = 5  # another rank died or did not answer within --timeout_s; the last complete checkpoint is kept
EXIT_PREEMPTED = 75  # stopped by SIGTERM/SIGUSR1 after saving a checkpoint: requeue and resume (EX_TEMPFAIL)

F = TypeVar("F", bound=Callable[..., object])


class UsageError(Exception):
    """Something the user passed is wrong; the message names it and says what to do."""


class NonFiniteError(Exception):
    """Training produced NaN or inf; the message names the step."""


class SaveError(OSError):
    """Writing a checkpoint or the export failed (disk full, ...); the message names it and says what is kept."""


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Timed out waiting", "Broken pipe", "Connection refused")


def is_rank_lost(error: BaseException) -> bool:
    """True when a collective failed because another rank is gone or hung past the process-group timeout.

    torch raises DistError subclasses for NCCL and the rendezvous store; gloo (CPU ranks) raises a
    plain RuntimeError whose message comes from gloo's transport and says what happened.
    """
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


def _release_process_group(error: BaseException | None = None) -> None:
    """Free the process group before Python shuts down (common.accelerator.release_process_group).

    The group is freed only once nothing refers to it, and the frames of a traceback keep main()'s
    model alive: `error`'s are cleared first.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    accelerator = sys.modules.get("common.accelerator")  # never imported here: the search runner has no torch
    if accelerator is not None:
        accelerator.release_process_group()


def _report(message: str, code: int, error: BaseException, every_rank: bool = False) -> None:
    _close_progress_bars()  # so the message starts on its own line, not after a half-drawn bar
    if every_rank or is_first_local_process():
        print(f"error: {message}", file=sys.stderr, flush=True)
    if code != EXIT_RANK_LOST:  # a collective may still wait on the lost rank: joining its thread could hang
        _release_process_group(error)
    sys.exit(code)


def report_usage_errors(main: F) -> F:
    """Run `main`; turn the errors a user can act on into `error: <message>` on stderr and an exit code.

    UsageError -> 2, NonFiniteError -> 3, SaveError or a full disk -> 4 (printed once per machine,
    as every rank raises them); a lost rank -> 5, printed by every rank that noticed, with its number.
    After main() returns or exits, and after those errors but a lost rank, the process group is freed
    before Python shuts down (common.accelerator.release_process_group).
    """

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            result = main(*args, **kwargs)
        except SystemExit as stop:  # main's own sys.exit(), e.g. EXIT_PREEMPTED
            _release_process_group(stop)
            raise
        except UsageError as error:
            _report(one_line(error), EXIT_USAGE, error)
        except NonFiniteError as error:
            _report(one_line(error), EXIT_NON_FINITE, error)
        except SaveError as error:
            _report(one_line(error), EXIT_SAVE_FAILED, error)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            where = f" writing {error.filename}" if error.filename else ""
            _report(f"disk full{where} ({error.strerror}); the checkpoints saved before are intact", EXIT_SAVE_FAILED,
                    error)
        except RuntimeError as error:
            if not is_rank_lost(error):
                raise
            rank = os.environ.get("RANK", "0")
            _report(f"rank {rank}: another rank died or did not answer within --timeout_s ({_peer_reason(error)}); "
                    "the last complete checkpoint is kept: resume with --resume auto", EXIT_RANK_LOST, error,
                    every_rank=True)
        _release_process_group()
        return result

    return wrapper  # type: ignore[return-value]
