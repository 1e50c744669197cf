"""common.accelerator's stop signals: what each signal means, on one process (2 ranks: test_fault_tolerance.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from common.accelerator import PreemptionWatcher, build_accelerator, end_run
from common.checkpoint import TrainingState
from common.errors import EXIT_PREEMPTED, RunStatus, StoppedBeforeTraining, at_failure, read_status, with_exit_codes
from common.tracking import Tracker


@pytest.fixture
def run(fresh_accelerate):
    """An accelerator and the stop-signal watcher of its run, past the session's first step (before it a signal ends
    the run at once: test_a_stop_before_the_first_step_...); the signal handlers are put back afterwards."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    accelerator = build_accelerator(seed=0)
    watcher = PreemptionWatcher(accelerator)
    watcher.session_steps = 1
    yield accelerator, watcher
    for signum, handler in previous.items():
        signal.signal(signum, handler)
    at_failure(None)  # RunStatus registered itself for the failure of a main() that never ran


@pytest.fixture
def watcher(run):
    return run[1]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_outside_a_sweep_either_signal_is_a_preemption_to_requeue(watcher, monkeypatch, signum):
    monkeypatch.delenv("WANDB_SWEEP_ID", raising=False)
    assert not watcher.stop_requested() and not watcher.requeue
    os.kill(os.getpid(), signum)
    assert watcher.stop_requested() and watcher.requeue
    assert watcher.stop_reason() == f"{signal.Signals(signum).name} (preemption)"


def test_under_wandb_agent_sigterm_stops_for_good_and_sigusr1_requeues(watcher, monkeypatch):
    monkeypatch.setenv("WANDB_SWEEP_ID", "abc123")
    monkeypatch.setenv("WANDB_RUN_ID", "run42")
    os.kill(os.getpid(), signal.SIGTERM)  # the agent's early termination
    assert watcher.stop_requested() and not watcher.requeue
    assert "from the W&B sweep agent" in watcher.stop_reason() and "not requeued" in watcher.stop_reason()
    os.kill(os.getpid(), signal.SIGUSR1)  # a preemption warning outranks the plain stop
    assert watcher.stop_requested() and watcher.requeue
    os.kill(os.getpid(), signal.SIGTERM)  # ... and is not undone by a later SIGTERM
    assert watcher.requeue


@pytest.mark.parametrize("sweep", [False, True])
def test_a_stop_before_the_first_step_ends_the_run_where_it_is_once(run, monkeypatch, sweep):
    """Before the session's first optimizer step (one process) the handler raises: nothing to save, and the launcher
    would kill the run before a step far away. A KeyboardInterrupt, as the libraries it interrupts expect; once: the
    launcher passes on a signal the process group got too, while the run ends."""
    for name in ("WANDB_SWEEP_ID", "WANDB_RUN_ID"):
        monkeypatch.setenv(name, "x") if sweep else monkeypatch.delenv(name, raising=False)
    watcher = run[1]
    watcher.session_steps = 0
    with pytest.raises(StoppedBeforeTraining) as stopped:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs at the next bytecode: never gets here
    assert isinstance(stopped.value, KeyboardInterrupt)
    assert (stopped.value.state, stopped.value.exit_code) == (("stopped", 0) if sweep else ("preempted", 75))
    assert stopped.value.reason == watcher.stop_reason() and watcher.stop_agreed
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher's copy of it: recorded, not raised
    assert watcher.received == signal.SIGTERM


END_OF = {  # how the loop ended -> (status.json's state, its reason, the exit code)
    "finished": ("finished", "", None),
    "stop_after_steps": ("stopped", "--stop_after_steps", None),
    "signal": ("preempted", "SIGUSR1 (preemption)", EXIT_PREEMPTED),
    # A signal after the ranks' last agreement (here while a finished run exports) stopped nothing
    "signal_after_the_last_step": ("finished", "", None),
    "early_stopping": ("finished", "early stopping: no better val/loss in 2 evaluations after step 3", None),
}


@pytest.fixture(autouse=True)
def ctrl_c_given_back():
    """end_run ignores Ctrl-C until main() returns, where with_exit_codes gives it back; called alone here, the test
    gives it back."""
    previous = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("end", sorted(END_OF))
def test_end_run_records_how_the_run_ended_and_why_from_the_agreed_stop(run, tmp_path, monkeypatch, capsys, end):
    monkeypatch.delenv("WANDB_SWEEP_ID", raising=False)
    accelerator, watcher = run
    status = RunStatus(accelerator, tmp_path, TrainingState(step=7))
    tracker = Tracker(accelerator, tmp_path, kind="none", project="", config={})
    if end == "signal":
        os.kill(os.getpid(), signal.SIGUSR1)
    assert watcher.stop_requested() == (end == "signal")  # the loop's last step: every rank agrees
    if end == "signal_after_the_last_step":
        os.kill(os.getpid(), signal.SIGUSR1)
    stopping = end in ("stop_after_steps", "signal")
    reason = END_OF["early_stopping"][1] if end == "early_stopping" else None  # the template's own reason
    state, recorded, exit_code = END_OF[end]
    if exit_code is None:
        end_run(accelerator, status=status, tracker=tracker, preemption=watcher, stopping=stopping, reason=reason)
    else:
        with pytest.raises(SystemExit) as exited:
            end_run(accelerator, status=status, tracker=tracker, preemption=watcher, stopping=stopping, reason=reason)
        assert exited.value.code == exit_code
    record = read_status(tmp_path)
    assert (record["state"], record["reason"], record["step"]) == (state, recorded, 7)
    printed = capsys.readouterr()
    line = f"stopped at step 7 by {recorded}; checkpoint saved, continue with --resume auto" if stopping else ""
    assert (printed.err if exit_code else printed.out).strip() == line  # requeued: on stderr, shown by the launcher


def test_a_ctrl_c_that_strikes_while_a_class_is_made_is_still_a_ctrl_c(capsys):
    """Found by scripts/stress_signals.py: a Ctrl-C passed on to a rank as its first checkpoint imported
    torch.distributed.checkpoint struck in a dataclass's creation, which Python 3.11 wraps in a RuntimeError ("Error
    calling __set_name__ ..."): status.json said failed, exit 1, with a traceback, instead of the Ctrl-C line."""
    class Field:
        def __set_name__(self, owner, name):
            raise KeyboardInterrupt  # where SIGINT's handler raised it

    def main():
        type("Made", (), {"field": Field()})  # a class made, as a dataclass is while a module is imported

    with pytest.raises(SystemExit) as exited:
        with_exit_codes(main, interrupted="continue with --resume auto")()
    assert exited.value.code == 130
    assert capsys.readouterr().err.strip() == "error: interrupted by Ctrl-C; continue with --resume auto"


def test_a_ctrl_c_while_the_process_group_is_freed_does_not_fail_a_finished_run():
    """Found by scripts/stress_signals.py: a Ctrl-C passed on by torchrun's agent as a rank freed its process group
    after main() had returned ended that finished run in a KeyboardInterrupt traceback."""
    freed = []

    def release():  # common.accelerator.release_process_group, and a Ctrl-C while it runs
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # a handled signal is acted on here
        freed.append(True)

    assert with_exit_codes(lambda: "done", release=release)() == "done"
    assert freed == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works again afterwards
