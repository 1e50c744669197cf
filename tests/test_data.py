"""common.data: loaders built by the template rules, seeded workers, per-epoch shuffles, disjoint splits."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, RandomSampler, SequentialSampler, TensorDataset

import common.data
from common.accelerator import build_accelerator
from common.data import (
    build_loader,
    build_loaders,
    default_num_workers,
    seed_worker,
    split_by_key,
    split_indices,
    stable_fraction,
)
from common.errors import UsageError
from conftest import CONFIGS, REPO, clean_env, free_port, launch, processes_mentioning, reset_accelerate_state
from conftest import run_to_end, wait_for_no_processes

CPU = torch.device("cpu")


def indices(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def order(loader) -> list[int]:
    """The sample indices one pass over `loader` yields, in order."""
    return [i for batch in loader for i in batch[0].tolist()]


class RandomDraws(Dataset):
    """Each item is (index, worker id, a draw from torch, numpy and `random`): shows how workers are seeded."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        info = torch.utils.data.get_worker_info()
        return index, info.id if info else -1, torch.rand(()).item(), float(np.random.rand()), random.random()


def first_draws(loader) -> dict[int, tuple[float, float, float]]:
    """worker id -> the (torch, numpy, random) numbers its first item drew."""
    draws = {}
    for _, worker, *numbers in (row for batch in loader for row in zip(*(x.tolist() for x in batch))):
        draws.setdefault(int(worker), tuple(numbers))
    return draws


# --- loader settings ----------------------------------------------------------------------------

def test_training_loader_shuffles_and_drops_last():
    loader = build_loader(indices(10), batch_size=4, train=True, seed=0, device=CPU)
    assert isinstance(loader.sampler, RandomSampler) and loader.drop_last is True
    seen = order(loader)
    assert len(seen) == 8 and len(loader) == 2  # the incomplete third batch is dropped
    assert seen != sorted(seen)


def test_evaluation_loader_keeps_order_and_every_sample():
    loader = build_loader(indices(10), batch_size=4, train=False, seed=0, device=CPU)
    assert isinstance(loader.sampler, SequentialSampler) and loader.drop_last is False
    assert order(loader) == list(range(10))  # no shuffle, last short batch kept
    assert [len(batch[0]) for batch in loader] == [4, 4, 2]


@pytest.mark.parametrize("device, pinned", [("cpu", False), ("cuda", True)])
def test_pin_memory_only_for_a_gpu(device, pinned):
    # Only built, never iterated, so a "cuda" device needs no GPU here.
    assert build_loader(indices(4), batch_size=2, train=True, seed=0, device=torch.device(device)).pin_memory is pinned


@pytest.mark.parametrize("device, pinned", [("cpu", False), ("cuda", True)])
def test_build_loaders_pins_memory_for_training_and_evaluation_on_a_gpu(device, pinned, monkeypatch, fresh_accelerate):
    """What the templates call: both loaders, as accelerate prepared them, pin memory where the accelerator's
    device is a GPU. The device is faked (a CPU Accelerator that says cuda): the loaders are built, never iterated."""
    accelerator = build_accelerator(seed=0)
    monkeypatch.setattr(type(accelerator), "device", property(lambda self: torch.device(device)))
    train, val, _ = build_loaders(accelerator, indices(16), indices(6), batch_size=4, seed=0, num_workers=0,
                                  what="samples")
    assert train.device == torch.device(device)  # the prepared loaders were made for that device
    assert train.pin_memory is pinned and val.pin_memory is pinned


def test_worker_settings():
    loader = build_loader(indices(8), batch_size=2, train=True, seed=0, device=CPU, num_workers=2, prefetch_factor=3)
    assert loader.num_workers == 2
    assert loader.persistent_workers is True
    assert loader.prefetch_factor == 3
    assert loader.worker_init_fn is seed_worker
    # Without workers DataLoader refuses prefetch_factor/persistent_workers; build_loader leaves them out.
    plain = build_loader(indices(8), batch_size=2, train=True, seed=0, device=CPU, num_workers=0, prefetch_factor=3)
    assert plain.num_workers == 0 and plain.persistent_workers is False and plain.prefetch_factor is None


@pytest.mark.parametrize("signal_name", ["TERM", "INT"])
def test_a_stop_signal_from_elsewhere_in_a_workers_first_moments_leaves_it_running(tmp_path, monkeypatch,
                                                                                   fresh_accelerate, signal_name):
    """A launcher that stops every rank (torchrun's agent signals each rank's process group) may signal a loader
    worker that has just been forked, before seed_worker shields it: an evaluation starting its loader's workers
    at that moment. The worker is forked with SIGTERM blocked, so it lives, and ignores it: a SIGTERM that is not
    its training process's. (Killed, it fails the training process: "DataLoader worker is killed by signal".)
    A Ctrl-C (SIGINT to the whole group) it leaves to its training process: it stayed blocked from the fork on (it
    struck at-fork hooks in a traceback, found by scripts/stress_signals.py, or ended the worker)."""
    started, sent = tmp_path / "started", tmp_path / "sent"
    shield = common.data.ignore_stop_signals_from_others

    def slow_to_shield():  # in the worker: the signal arrives before the shield is up
        (tmp_path / "starting").write_text(str(os.getpid()))
        os.replace(tmp_path / "starting", started)  # whole: the test reads the pid as soon as the file is there
        deadline = time.monotonic() + 30
        while not sent.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        shield()

    monkeypatch.setattr(common.data, "ignore_stop_signals_from_others", slow_to_shield)
    _, loader, _ = build_loaders(build_accelerator(seed=0), indices(8), indices(8), batch_size=2, seed=0,
                                 num_workers=1, what="samples")  # the evaluation loader, as the templates get it
    seen: list = []

    def evaluate():  # forks the worker at its first batch, and waits for it
        try:
            seen.extend(i for batch in loader for i in batch[0].tolist())
        except Exception as error:
            seen.append(error)

    evaluation = threading.Thread(target=evaluate)
    evaluation.start()
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    worker = int(started.read_text())
    subprocess.run(["kill", f"-{signal_name}", str(worker)], check=True)  # from another process, as a launcher's
    sent.touch()
    evaluation.join(60)
    assert seen == list(range(8))
    os.kill(worker, 0)  # still there (it lives with the loader: persistent workers)


SLOW_WORKER_START = """
import os, time
import torch.utils.data._utils.worker as worker

_loop = worker._worker_loop


def slow_loop(*args, **kwargs):  # a loader worker slow to start: its training process can die meanwhile
    folder = os.environ["SLOW_WORKERS"]
    open(f"{folder}/.{os.getpid()}", "w").close()
    os.replace(f"{folder}/.{os.getpid()}", f"{folder}/worker-{os.getpid()}")  # whole, as the test reads it at once
    time.sleep(3)
    return _loop(*args, **kwargs)


worker._worker_loop = slow_loop
"""


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def is_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("processes", [1, 2])
def test_a_rank_killed_while_its_loader_worker_starts_leaves_nothing_behind(tmp_path, processes):
    """The OOM killer at an epoch's start: a rank SIGKILLed while its loader worker starts. torch's watchdog reads the
    worker's parent only when its loop starts, so before the fix that worker watched pid 1 and lived for good (ignoring
    a shell's SIGTERM too), holding the launcher's stdout open. The worker sleeps 3 s at its start (a sitecustomize);
    the rank is killed then. Its worker must end at once, and the whole run soon (2 ranks: the other notices)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_WORKER_START)
    output = tmp_path / "run"
    config = CONFIGS / ("cpu_ddp.yaml" if processes > 1 else "cpu.yaml")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--main_process_port", str(free_port()), "--num_processes", str(processes),
               str(REPO / "templates" / "image_classification.py"), "--epochs", "1",
               "--width", "8", "--depth", "1", "--num_workers", "1", "--tracker", "none", "--output_dir", str(output)]
    launcher = subprocess.Popen(command, cwd=REPO, env=clean_env(PYTHONPATH=str(site), SLOW_WORKERS=str(tmp_path)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (started := list(tmp_path.glob("worker-*"))) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert started, "no loader worker started"
        worker = int(started[0].name.split("-")[1])
        os.kill(parent_of(worker), signal.SIGKILL)  # while the worker sleeps through its start
        deadline = time.monotonic() + 10
        while (alive := is_alive(worker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive, "the loader worker outlived its rank"
        assert launcher.wait(timeout=90) != 0
        assert wait_for_no_processes(str(output), timeout=10) == []
    finally:
        launcher.kill()
        for line in processes_mentioning(str(output)):  # what this test started and left
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


FORKED_FROM_A_THREAD = """
import sys, threading, time
import torch
from torch.utils.data import TensorDataset
sys.path.insert(0, {repo!r})
from common.data import build_loader

loader = build_loader(TensorDataset(torch.arange(8)), batch_size=2, train=False, seed=0, device=torch.device("cpu"),
                      num_workers=1)
threading.Thread(target=lambda: list(loader), daemon=True).start()  # the worker is forked from this thread
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_forked_from_another_thread_ends_with_its_process_killed_while_it_starts(tmp_path):
    """A loader iterated from a thread other than the main one: Linux's parent-death signal would fire when that
    thread ends, so it is not set; a worker whose process is killed while it starts must end all the same (the
    stop-signal shield exits a worker whose parent is gone, where torch's watchdog would watch pid 1 for good)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_WORKER_START)
    script = tmp_path / "threaded.py"
    script.write_text(FORKED_FROM_A_THREAD.format(repo=str(REPO)))
    process = subprocess.Popen([sys.executable, str(script)], env=clean_env(PYTHONPATH=str(site),
                               SLOW_WORKERS=str(tmp_path)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (started := list(tmp_path.glob("worker-*"))) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert started, "no loader worker started"
        worker = int(started[0].name.split("-")[1])
        process.kill()  # while the worker sleeps through its start
        process.wait()
        deadline = time.monotonic() + 10  # its start (3 s) and a second of the shield's wait
        while (alive := is_alive(worker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive, "the loader worker outlived its process"
    finally:
        process.kill()
        for line in processes_mentioning(str(script)):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


HOLD_THREAD_STATE_LOCK = r"""
#define Py_BUILD_CORE 1
#include <Python.h>
#include "internal/pycore_runtime.h"
#include <pthread.h>
#include <unistd.h>

/* What gloo's threads do after a collective, stretched: a thread with no Python state takes CPython's thread-state
   lock without the GIL (to make itself a state) and, here, keeps it for a while. */
static volatile int held;
static double seconds;

static void *hold(void *unused) {
    PyThread_acquire_lock(_PyRuntime.interpreters.mutex, WAIT_LOCK);
    held = 1;
    usleep((useconds_t)(seconds * 1e6));
    PyThread_release_lock(_PyRuntime.interpreters.mutex);
    return NULL;
}

int hold_thread_state_lock(double duration) {
    pthread_t thread;
    seconds = duration;
    if (pthread_create(&thread, NULL, hold, NULL)) return -1;
    pthread_detach(thread);
    while (!held) usleep(100);
    return 0;
}
"""

FORK_WHILE_HELD = """
import ctypes, sys
import torch
from torch.utils.data import TensorDataset
sys.path.insert(0, {repo!r})
from common.data import build_loader

loader = build_loader(TensorDataset(torch.arange(8)), batch_size=2, train=False, seed=0, device=torch.device("cpu"),
                      num_workers=1)
loader.timeout = 60  # a worker hung in its fork sends nothing: fail rather than wait for good
holder = ctypes.CDLL({library!r})
holder.hold_thread_state_lock.argtypes = [ctypes.c_double]
assert holder.hold_thread_state_lock(1.0) == 0
print("samples", sum(len(batch[0]) for batch in loader))
"""


@pytest.mark.skipif(sys.version_info >= (3, 12) or sys.implementation.name != "cpython" or shutil.which("gcc") is None,
                    reason="CPython 3.11 and older with a C compiler (3.12 resets the lock in the child first)")
def test_a_worker_forked_while_a_native_thread_holds_the_thread_state_lock_starts(tmp_path):
    """CPython 3.11.7 hung a loader worker inside os.fork() (gh-112275: the child takes the thread-state lock before
    resetting it). Seen in a 2-rank run: a gloo thread took that lock, without the GIL, as the evaluation loader forked.
    Here a native thread holds it for a second while the loader forks its worker: the worker must start and serve."""
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "internal" / "pycore_runtime.h").exists():
        pytest.skip("no CPython internal headers")
    source, library = tmp_path / "hold.c", tmp_path / "hold.so"
    source.write_text(HOLD_THREAD_STATE_LOCK)
    subprocess.run(["gcc", "-shared", "-fPIC", f"-I{include}", str(source), "-o", str(library), "-lpthread"],
                   check=True, capture_output=True)
    script = tmp_path / "fork_while_held.py"
    script.write_text(FORK_WHILE_HELD.format(repo=str(REPO), library=str(library)))
    result = run_to_end([sys.executable, str(script)], cwd=tmp_path, env=clean_env(), timeout=120)
    assert result.returncode == 0 and "samples 8" in result.stdout, result.stderr[-3000:]


def test_batch_size_checked():
    with pytest.raises(UsageError, match="batch_size must be at least 1, got 0"):
        build_loader(indices(4), batch_size=0, train=True, seed=0, device=CPU)


@pytest.mark.parametrize("cores, world_size, expected", [
    (1, 1, 0), (2, 1, 1), (4, 1, 3), (9, 2, 4), (4, 4, 0), (64, 1, 8), (64, 4, 8), (17, 4, 4),
])
def test_default_num_workers_leaves_a_core_and_shares_the_rest(monkeypatch, cores, world_size, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert default_num_workers(world_size) == expected


# --- worker seeds -------------------------------------------------------------------------------

def worker_loader(rank: int = 0, seed: int = 7):
    return build_loader(RandomDraws(), batch_size=1, train=False, seed=seed, device=CPU, rank=rank, num_workers=2)


def test_workers_draw_different_numbers_reproducibly_and_per_rank():
    draws = first_draws(worker_loader())
    assert sorted(draws) == [0, 1]
    for library in range(3):  # torch, numpy, random: each differs between the two workers
        assert draws[0][library] != draws[1][library]
    # Reruns draw the same numbers, whatever the main process's own RNGs are doing.
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    assert first_draws(worker_loader()) == draws
    # Another rank (or another seed) draws other numbers, in every worker.
    for other in (first_draws(worker_loader(rank=1)), first_draws(worker_loader(seed=8))):
        assert set(other.values()).isdisjoint(draws.values())


def test_seed_worker_seeds_numpy_and_random_from_the_torch_seed():
    torch.manual_seed(1234)
    seed_worker(0)
    a = (np.random.rand(), random.random())
    np.random.seed(0), random.seed(0)
    torch.manual_seed(1234)
    seed_worker(0)
    assert (np.random.rand(), random.random()) == a
    torch.manual_seed(1235)
    seed_worker(0)
    assert np.random.rand() != a[0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterating_does_not_consume_the_global_torch_rng(num_workers):
    # Dropout masks after a resume depend on the global RNG; a loader that drew from it would shift them.
    loader = build_loader(indices(8), batch_size=2, train=True, seed=0, device=CPU, num_workers=num_workers)
    state = torch.get_rng_state()
    for _ in range(2):
        order(loader)
    assert torch.equal(torch.get_rng_state(), state)


# --- shuffles through an accelerate-prepared loader ------------------------------------------------

def prepared(seed: int = 11, rank: int = 0, n: int = 24, batch_size: int = 4, train: bool = True):
    """A loader as the templates use it: built here, prepared by a fresh `build_accelerator` Accelerator."""
    reset_accelerate_state()
    accelerator = build_accelerator(seed=seed)
    loader = build_loader(indices(n), batch_size=batch_size, train=train, seed=seed, device=accelerator.device,
                          rank=rank)
    return accelerator, accelerator.prepare(loader)


def epoch_order(loader, epoch: int) -> list[int]:
    loader.set_epoch(epoch)
    return order(loader)


def test_set_epoch_gives_each_epoch_its_own_reproducible_shuffle(fresh_accelerate):
    _, loader = prepared()
    orders = [epoch_order(loader, epoch) for epoch in range(3)]
    assert all(sorted(o) == list(range(24)) for o in orders)
    assert len({tuple(o) for o in orders}) == 3  # every epoch shuffles differently
    assert epoch_order(loader, 1) == orders[1]  # and the same epoch again shuffles the same way
    # The shuffle of epoch e depends on (seed, e) only: a new job (after a resume, say) that starts at
    # epoch 2 sees the same order, whatever the global RNG holds and whichever rank builds it.
    torch.manual_seed(99)
    _, again = prepared(rank=1)
    assert epoch_order(again, 2) == orders[2]
    _, other_seed = prepared(seed=12)
    assert epoch_order(other_seed, 2) != orders[2]


def test_skipping_batches_on_resume_continues_the_same_epoch(fresh_accelerate):
    accelerator, loader = prepared()
    full = epoch_order(loader, 3)
    loader.set_epoch(3)
    assert order(accelerator.skip_first_batches(loader, 2)) == full[8:]


def test_prepared_loader_does_not_consume_the_global_torch_rng(fresh_accelerate):
    _, loader = prepared()
    state = torch.get_rng_state()
    epoch_order(loader, 0)
    epoch_order(loader, 1)
    assert torch.equal(torch.get_rng_state(), state)


def test_prepared_evaluation_loader_is_in_order_and_complete(fresh_accelerate):
    _, loader = prepared(n=10, train=False)
    assert order(loader) == list(range(10))


MULTI_RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {tests!r})
    from common.accelerator import build_accelerator
    from common.data import build_loader
    from test_data import RandomDraws, indices, order

    accelerator = build_accelerator(seed=5)
    rank = accelerator.process_index
    shuffled = build_loader(indices(22), batch_size=2, train=True, seed=5, device=accelerator.device, rank=rank)
    draws = build_loader(RandomDraws(), batch_size=1, train=False, seed=5, device=accelerator.device, rank=rank,
                         num_workers=2)
    shuffled, draws = accelerator.prepare(shuffled, draws)
    rng = torch.get_rng_state()
    epochs = []
    for epoch in range(2):
        shuffled.set_epoch(epoch)
        epochs.append(order(shuffled))
    out = {{"world": accelerator.num_processes, "epochs": epochs,
           "rng_untouched": torch.equal(rng, torch.get_rng_state()),
           "draws": [row[2] for batch in draws for row in zip(*(x.tolist() for x in batch))]}}
    with open(sys.argv[1] + f"/rank{{rank}}.json", "w") as handle:
        json.dump(out, handle)
""")


def test_two_ranks_shard_one_shuffle_and_seed_workers_apart(tmp_path):
    script = tmp_path / "shards.py"
    script.write_text(MULTI_RANK_SCRIPT.format(repo=str(REPO), tests=str(REPO / "tests")))
    result = launch("cpu_ddp.yaml", script, str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]  # one job of two ranks, not two jobs of one
    for epoch in range(2):
        shard0, shard1 = ranks[0]["epochs"][epoch], ranks[1]["epochs"][epoch]
        # Both ranks cut their shard from the same permutation: together they are disjoint and (less the
        # dropped incomplete batch) complete, and equally long, so no rank waits for the other.
        assert len(shard0) == len(shard1) == 10
        assert set(shard0).isdisjoint(shard1) and set(shard0 + shard1) <= set(range(22))
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # a new shuffle each epoch
    assert all(r["rng_untouched"] for r in ranks)
    # The evaluation loader's workers draw different numbers on the two ranks.
    assert len(ranks[0]["draws"]) == len(ranks[1]["draws"]) == 4
    assert set(ranks[0]["draws"]).isdisjoint(ranks[1]["draws"])


# --- splits -------------------------------------------------------------------------------------

def test_split_indices_is_disjoint_complete_and_seeded():
    train, val = split_indices(100, 0.2, seed=3)
    assert len(val) == 20 and sorted(train + val) == list(range(100))
    assert set(train).isdisjoint(val)
    assert train == sorted(train) and val == sorted(val)
    torch.manual_seed(0)  # the global RNG plays no part
    assert split_indices(100, 0.2, seed=3) == (train, val)
    assert split_indices(100, 0.2, seed=4) != (train, val)


def test_split_indices_always_leaves_both_splits_non_empty():
    assert len(split_indices(3, 0.01, seed=0)[1]) == 1
    with pytest.raises(UsageError, match="too few"):
        split_indices(1, 0.5, seed=0)


def test_stable_fraction_is_fixed_by_the_key_alone():
    # Pinned values: a split must not change with the machine, the run (Python's hash() is salted per
    # process) or the Python version.
    assert stable_fraction("cats/001.jpg") == 0.8757651403092347
    assert stable_fraction("dogs/002.png") == 0.27236632616511736
    assert all(0.0 <= stable_fraction(f"k{i}") < 1.0 for i in range(200))


def test_split_by_key_disjoint_and_stable_when_items_are_added():
    keys = [f"class{i % 3}/img{i:04d}.jpg" for i in range(600)]
    train, val = split_by_key(keys, 0.25)
    assert set(train).isdisjoint(val) and sorted(train + val) == list(range(600))
    assert 0.18 < len(val) / 600 < 0.32
    in_val = {keys[i] for i in val}
    # Adding files, and listing them in another order, moves no existing file to the other split.
    more = list(reversed(keys)) + [f"class9/new{i}.jpg" for i in range(300)]
    train2, val2 = split_by_key(more, 0.25)
    assert {more[i] for i in val2} & set(keys) == in_val
    assert {more[i] for i in train2} & set(keys) == set(keys) - in_val

