"""common.accelerator's stop signals: what each signal means, on one process (2 ranks: test_fault_tolerance.py)."""

from __future__ import annotations

import os
import signal

import pytest

from common.accelerator import PreemptionWatcher, build_accelerator


@pytest.fixture
def watcher(fresh_accelerate, monkeypatch):
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    yield PreemptionWatcher(build_accelerator(seed=0))
    for signum, handler in previous.items():
        signal.signal(signum, handler)


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
