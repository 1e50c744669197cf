"""Data loaders built by the rules in README (seeded workers, shuffling and drop_last for training only), splits that
never overlap, token streams read in fixed windows (memory-mapped token files), the records of a dataset source (files,
folders, `save_to_disk` folders, Hub ids), and examples padded or packed into batches."""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import json
import math
import multiprocessing
import multiprocessing.context
import os
import random
import re
import signal
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler

from common.errors import UsageError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what launchers and Slurm send to stop a run (common.accelerator)
_FORKED_BY: int | None = None  # in a worker forked through worker_context(): its training process, read before the fork


def seed_worker(worker_id: int) -> None:
    """Seed numpy and `random` in a loader worker from the seed torch gave it (libraries that keep their own RNG would
    otherwise start identically in every worker); shield it from stop signals."""
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)
    if torch.utils.data.get_worker_info() is not None:  # only in a real worker, never in the caller's process
        ignore_stop_signals_from_others()


def ignore_stop_signals_from_others() -> None:
    """In a loader worker: ignore SIGTERM and SIGUSR1 (launchers and Slurm signal every process of a job; a worker
    killed by one would fail the training process before it can checkpoint), but end at the training process's SIGTERM,
    as torch's worker handler does, and within a second once it is gone (torch's watchdog, reading the parent as its
    loop starts, may watch pid 1 for good). A thread waits for them: there the sender's pid is known. Linux only.
    `worker_context()` forks workers with these signals blocked, so one sent before this runs waits here."""
    if not hasattr(signal, "sigtimedwait"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # threads started from here on inherit the mask
    parent = _FORKED_BY or os.getppid()

    def wait() -> None:
        while True:
            info = signal.sigtimedwait(STOP_SIGNALS, 1.0)
            if os.getppid() != parent or (info and info.si_signo == signal.SIGTERM and info.si_pid == parent):
                os._exit(0)

    threading.Thread(target=wait, name="loader-stop-signals", daemon=True).start()


def end_with_parent(parent: int, forked_on_main_thread: bool) -> None:
    """In a process just forked by `parent`: die with it, also if it died already (PDEATHSIG: main thread only)."""
    if forked_on_main_thread and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _wait_for_the_thread_state_lock() -> None:
    """Before a fork: wait until no thread holds CPython's thread-state lock. CPython 3.11 and older, until patch
    releases of late 2024 (gh-112275), take it in the child before they reset it: a child forked while another thread
    holds it hangs for good. Native threads take it without the GIL whenever they touch a Python object: gloo's and
    NCCL's do after every collective, just before a loader starts its workers. Signalling a thread id no thread has
    takes the lock and nothing else."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(0), None)


if sys.version_info < (3, 12) and sys.implementation.name == "cpython":  # runs right before fork(), in the parent
    os.register_at_fork(before=_wait_for_the_thread_state_lock)


class _ShieldedForkProcess(multiprocessing.context.ForkProcess):
    """A loader worker forked with stop signals blocked, ending with its training process."""

    def start(self) -> None:
        self._forked_by = os.getpid()
        self._forked_on_main_thread = threading.current_thread() is threading.main_thread()
        # This thread only, for the fork; the child keeps SIGINT blocked: it leaves a Ctrl-C to its training process
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, (*STOP_SIGNALS, signal.SIGINT))
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def _bootstrap(self, *args, **kwargs):  # in the child, right after the fork
        global _FORKED_BY
        _FORKED_BY = self._forked_by
        end_with_parent(self._forked_by, self._forked_on_main_thread)
        return super()._bootstrap(*args, **kwargs)


class _ShieldedForkContext(multiprocessing.context.ForkContext):
    Process = _ShieldedForkProcess


def worker_context() -> multiprocessing.context.BaseContext | None:
    """The loaders' multiprocessing context: where the default forks (Linux before Python 3.14), one that starts
    workers shielded from stop signals; else None (the default as it is)."""
    method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    return _ShieldedForkContext() if method == "fork" and hasattr(signal, "sigtimedwait") else None


def default_num_workers(local_processes: int | None = None) -> int:
    """Leave one core for the training process; share the rest between the processes on this machine.
    `local_processes` defaults to LOCAL_WORLD_SIZE, which the launcher sets (other machines have their own cores)."""
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(8, (cores - 1) // max(1, local_processes)))


def build_loader(dataset: Dataset, *, batch_size: int, train: bool, seed: int, device: torch.device, rank: int = 0,
                 num_workers: int = 0, prefetch_factor: int = 2, collate_fn=None) -> DataLoader:
    """A DataLoader by the template rules; pass it to `accelerator.prepare`. Only training shuffles and drops the
    last incomplete batch. The shuffle comes from the sampler's own generator (accelerate reseeds it with seed +
    epoch): the same permutation on every rank, each taking its shard. Worker seeds come from a generator seeded per
    rank: ranks and workers draw different numbers, reproducibly, and an iterator never consumes the global torch
    RNG (which would shift dropout masks after a resume). Memory is pinned only for a GPU `device`."""
    if batch_size < 1:
        raise UsageError(f"batch_size must be at least 1, got {batch_size}")
    sampler_generator = torch.Generator().manual_seed(seed)
    worker_generator = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * (rank + 1) + (0 if train else 1))
    sampler = RandomSampler(dataset, generator=sampler_generator) if train else SequentialSampler(dataset)
    extra = {}
    if num_workers > 0:
        # Workers that live across epochs skip the fork cost each epoch; prefetch keeps them ahead.
        extra = {"persistent_workers": True, "prefetch_factor": prefetch_factor, "worker_init_fn": seed_worker,
                 "multiprocessing_context": worker_context()}  # seed_worker shields them from stop signals
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=train, num_workers=num_workers,
                      pin_memory=device.type == "cuda", generator=worker_generator, collate_fn=collate_fn, **extra)


def build_loaders(accelerator, train_set: Dataset, val_set: Dataset, *, batch_size: int, seed: int,
                  num_workers: int, what: str, collate_fn=None):
    """The training and validation loaders, prepared (each rank holds its shard), and the training
    loader's micro-batches per epoch. Refuses a training set with no full batch per process and warns,
    on the main process, when whole batches leave much of it out (`check_full_batches`)."""
    loader_args = dict(batch_size=batch_size, seed=seed, device=accelerator.device, rank=accelerator.process_index,
                       num_workers=num_workers, collate_fn=collate_fn)
    train_loader, val_loader = accelerator.prepare(build_loader(train_set, train=True, **loader_args),
                                                   build_loader(val_set, train=False, **loader_args))
    warning = check_full_batches(len(train_loader), len(train_set), batch_size, accelerator.num_processes, what)
    if warning:
        accelerator.print(f"warning: {warning}")
    return train_loader, val_loader, len(train_loader)


def check_full_batches(batches: int, samples: int, batch_size: int, processes: int, what: str) -> str | None:
    """Refuse a training set that fills no batch on each process; a warning (else None) when the `batches` of the
    prepared training loader (full ones per process and epoch) leave out 10% or more of the `samples`."""
    procs = f"{processes} process{'es' if processes > 1 else ''}"
    if batches == 0:
        if samples < processes:
            raise UsageError(f"{samples} {what} are too few for {procs}: each needs at least one")
        raise UsageError(f"{samples} {what} make no full batch of {batch_size} per process ({procs}): "
                         f"use --batch_size {samples // processes} or less")
    used = batches * batch_size * processes
    if samples - used >= 0.1 * samples:
        left = samples - used
        return (f"full batches of --batch_size {batch_size} on {procs} take {used} of the {samples} {what}, leaving "
                f"{left} ({left / samples:.0%}) out of every epoch; a smaller --batch_size leaves fewer out")
    return None


def stable_fraction(key: str) -> float:
    """A number in [0, 1) fixed by `key` alone: the same on every machine, run and Python version."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_by_key(keys: Sequence[str], val_fraction: float) -> tuple[list[int], list[int]]:
    """Split items (files, say) by a stable hash of their key: an item never changes split when others are added.
    `val_fraction` is in (0, 1), as the templates' --val_fraction range makes it."""
    train, val = [], []
    for index, key in enumerate(keys):
        (val if stable_fraction(key) < val_fraction else train).append(index)
    return train, val


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded random split of range(n) into train and validation indices (`val_fraction` in (0, 1))."""
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise UsageError(f"{n} samples are too few to split off a validation fraction of {val_fraction}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[n_val:]), sorted(order[:n_val])


# ------------------------------------------------------------------------------- token streams
class TokenWindows(Dataset):
    """Window i of a token stream: inputs tokens[s:s+T], targets tokens[s+1:s+T+1], s = start + i*T, visited in a
    new order each epoch. An item is a pure function of its index, so the data position a checkpoint saves is enough
    for an exact resume (persistent workers would never see a per-epoch offset). Token files are memory-mapped."""

    def __init__(self, tokens: np.ndarray | Path, block_size: int, start: int = 0, stop: int | None = None):
        self.tokens, self.block_size, self.start = tokens, block_size, start
        self.stop = stop if stop is not None else len(self.array())
        self._memmap = None

    def array(self) -> np.ndarray:
        if isinstance(self.tokens, np.ndarray):
            return self.tokens
        if getattr(self, "_memmap", None) is None:
            self._memmap = np.memmap(self.tokens, dtype=np.uint16, mode="r")
        return self._memmap

    def __getstate__(self) -> dict:
        return self.__dict__ | {"_memmap": None}  # a pickled memmap would be a full in-memory copy

    def __len__(self) -> int:
        return max(0, (self.stop - self.start - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        begin = self.start + index * self.block_size
        chunk = torch.from_numpy(self.array()[begin : begin + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def token_file(path: Path) -> Path:
    try:
        size = path.stat().st_size
        path.open("rb").close()  # it is memory-mapped later, in the loader
    except OSError as error:
        raise UsageError(f"cannot read token file {path} ({error.strerror})") from None
    if size == 0:
        raise UsageError(f"token file {path} is empty")
    if size % 2:
        raise UsageError(f"token file {path} has {size} bytes, not a multiple of 2: not a file of uint16 tokens")
    return path


def largest_token(path: Path) -> int:
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    chunk = 1 << 24  # a scan in pieces: many-GB files are never read into memory at once
    return max(int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk))


def token_file_splits(path: Path, block_size: int, val_fraction: float,
                      vocab_size: int = 0) -> tuple[TokenWindows, TokenWindows, int]:
    """nanoGPT's token files: training and validation windows, and the vocabulary size. A folder holds `train.bin`
    and `val.bin` (as nanoGPT's prepare.py writes them); a single `.bin` file has its tail held out. `vocab_size` 0
    takes the largest token id + 1, rounded up to a multiple of 64."""
    if path.is_dir():
        if not (path / "val.bin").is_file():
            raise UsageError(f"--data_path {path}: has train.bin but no val.bin")
        train_file, val_file = token_file(path / "train.bin"), token_file(path / "val.bin")
        train, val = TokenWindows(train_file, block_size), TokenWindows(val_file, block_size)
        largest = max(largest_token(train_file), largest_token(val_file)) if vocab_size == 0 else 0
    else:
        n = token_file(path).stat().st_size // 2
        cut = n - int(n * val_fraction)
        train, val = TokenWindows(path, block_size, 0, cut), TokenWindows(path, block_size, cut, n)
        largest = largest_token(path) if vocab_size == 0 else 0
    return train, val, vocab_size or 64 * math.ceil((largest + 1) / 64)


# ------------------------------------------------------------------------------ dataset sources
DATASET_FILES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}  # what `datasets` reads
SAVED_DATASET = ("dataset_info.json", "dataset_dict.json", "state.json")  # what `save_to_disk` writes
Rows = Iterable[tuple[str, object, str]]  # (where: "line 3" / "row 2", the record, its key: what a hash split reads)


class DataSource:
    """What --data_path names: plain text (a .txt file or a folder of text files: `text_files`), or records, read
    split by split (`splits`) from a JSONL, JSON, parquet or CSV file or a folder of them, a `save_to_disk` folder or
    a Hub dataset id. A path that is not there, or a --data_config it cannot have, is refused here."""

    def __init__(self, data_path: str | None, data_config: str = ""):
        if data_path is None:
            raise UsageError("pass --data_path: a JSONL, JSON, parquet or CSV file or a folder of them, a save_to_disk "
                             "folder, a Hub dataset id, or text")
        self.name, self.config, self.path = data_path, data_config, Path(data_path)
        path = self.path
        hub_id = re.fullmatch(r"[\w.-]+(/[\w.-]+)?", data_path) and path.suffix not in (*DATASET_FILES, ".txt")
        if not path.exists() and not hub_id:
            raise UsageError(f"--data_path {path}: no such file or folder")
        if data_config and path.exists() and (path.is_file() or is_saved_dataset(path) or is_plain_text(path)):
            raise UsageError(f"--data_config names a configuration of a Hub dataset or of a folder of data files; "
                             f"--data_path {path} has none")

    def text_files(self) -> list[Path] | None:
        """The text files in sorted order (a folder's, hidden ones left out), or None where the source holds records."""
        path = self.path
        if not (path.exists() and is_plain_text(path)):
            return None
        return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")) if path.is_dir() \
            else [path]

    def splits(self, split: str, val_split: str) -> tuple[tuple[str, Rows], tuple[str, Rows] | None]:
        """The rows of the training split and of the validation split (--data_val_split; '': 'validation' if the
        data has it, else None), each with the name errors give it: the path, and the split where there are several."""
        path = self.path
        found = {"train": jsonl_rows(path)} if path.suffix == ".jsonl" and path.is_file() else {  # rows from 0, as
            name: ((f"row {i}", row, record_key(row)) for i, row in enumerate(rows)) for name, rows in  # dataset[i]
            self.load().items()}
        for name in (split, val_split):
            if name and name not in found:
                raise UsageError(f"--data_path {path} has no split {name!r} (its splits: {', '.join(found)})")
        if val_split == split:
            raise UsageError(f"--data_val_split {val_split!r} is the training split too")
        val_split = val_split or ("validation" if split != "validation" else "")
        source = {name: f"{path} ({name} split)" if len(found) > 1 else str(path) for name in found}
        return (source[split], found[split]), (source[val_split], found[val_split]) if val_split in found else None

    def load(self) -> dict:
        """Split name -> `datasets.Dataset`: a file or a folder of data files or a Hub id (`load_dataset`; a folder's
        split names come from its file names: train*, validation*, test*), or a `save_to_disk` folder."""
        import datasets  # here only: the other templates, JSONL and text data never need it

        datasets.utils.logging.set_verbosity_error()
        path = self.path
        if path.exists():
            datasets.disable_progress_bars()  # quick on local files; a Hub download keeps its progress bars
        try:
            if is_saved_dataset(path):
                loaded = datasets.load_from_disk(str(path))
            elif path.is_file():
                loaded = datasets.load_dataset(DATASET_FILES[path.suffix], data_files=str(path))
            else:
                loaded = datasets.load_dataset(self.name, name=self.config or None)
        except Exception as error:  # datasets' and pyarrow's own errors: one line, whatever their kind
            reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
            raise UsageError(f"--data_path {path}: " + ("cannot load it" if path.exists() else "no such file or "
                             "folder, and `datasets` cannot load it as a Hub dataset") + f" ({reason})") from None
        return {"train": loaded} if isinstance(loaded, datasets.Dataset) else dict(loaded)


def jsonl_rows(path: Path) -> Iterator[tuple[str, object, str]]:
    """A JSONL file line by line, without `datasets` (its errors name the line)."""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError as error:
                raise UsageError(f"{path} line {number}: not JSON ({error})") from None
            yield f"line {number}", record, record_key(record)


RECORD_KEYS = "content as canonical JSON"  # what a record's key is: recorded with a run whose split reads it


def record_key(record) -> str:
    """What a hash split reads of a record: its content as canonical JSON (sorted keys, compact, non-ASCII as is), a
    null field as an absent one (`datasets` fills absent cells with None): the same records split alike from JSONL
    (however written), JSON, parquet or CSV (the same JSON values, with the types each format keeps)."""
    present = json.loads(json.dumps(record, default=str),
                         object_hook=lambda fields: {k: v for k, v in fields.items() if v is not None})
    return json.dumps(present, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in SAVED_DATASET)


def is_plain_text(path: Path) -> bool:
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return not any(f.suffix in DATASET_FILES or f.name in SAVED_DATASET for f in files)


# --------------------------------------------------------------------------- padded or packed batches
# Packing (the fine-tuning template): whole examples in rows of up to `max_length` tokens, no compute on padding, and
# no example attending to another: transformers builds a block-diagonal causal mask from position ids that restart at
# each example when the forward gets no attention mask and builds no cache (SDPA, eager, flex; flash attention reads
# the ids itself). So a packed batch is input ids, position ids and labels only, and the forward gets use_cache=False.
IGNORE = -100  # label of a token that is not learned (torch's cross-entropy ignore_index)
PACKABLE_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
PACKABLE_LAYERS = ("full_attention", "sliding_attention")


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of examples grouped into rows of at most `capacity` tokens, best fit decreasing (the longest first,
    each into the fullest row it fits in). Deterministic (ties by index); rows keep their examples in index order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row number), sorted: the fullest row that fits is the first >=
    for index in order:
        length = lengths[index]
        if length > capacity:
            raise ValueError(f"example {index} has {length} tokens, more than a row's {capacity}")
        spot = bisect.bisect_left(free, (length, -1))
        if spot == len(free):
            rows.append([index])
            room, row = capacity - length, len(rows) - 1
        else:
            room, row = free.pop(spot)
            rows[row].append(index)
            room -= length
        if room > 0:
            bisect.insort(free, (room, row))
    return [sorted(row) for row in rows]


class PackedExamples(Dataset):
    """Rows of (input_ids, labels) examples: packed into `capacity` tokens a row, or one example a row (None)."""

    def __init__(self, examples: list[tuple[list[int], list[int]]], capacity: int | None = None):
        self.examples = examples
        self.rows = pack([len(x) for x, _ in examples], capacity) if capacity else [[i] for i in range(len(examples))]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[tuple[list[int], list[int]]]:
        return [self.examples[i] for i in self.rows[index]]

    def filled(self, capacity: int) -> float:
        """The share of the rows' tokens that are examples' (the rest would be padding)."""
        return sum(len(ids) for ids, _ in self.examples) / max(1, capacity * len(self.rows))


class PackedCollate:
    """Collate rows of examples: input ids, position ids restarting at each example, labels IGNORE at each example's
    first token (none learns from the one before), rows padded to the longest by a segment of their own; no
    attention mask. `tokens`: the examples' tokens (padding excluded), for the throughput."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[list[tuple[list[int], list[int]]]]) -> dict[str, torch.Tensor]:
        input_ids, position_ids, labels = [], [], []
        for row in rows:
            ids, positions, targets = [], [], []
            for example_ids, example_labels in row:
                ids += example_ids
                positions += range(len(example_ids))
                targets += [IGNORE] + list(example_labels[1:])
            input_ids.append(ids)
            position_ids.append(positions)
            labels.append(targets)
        longest = max(len(ids) for ids in input_ids)
        tokens = sum(len(ids) for ids in input_ids)
        for ids, positions, targets in zip(input_ids, position_ids, labels):
            pad = longest - len(ids)
            ids += [self.pad_id] * pad
            positions += range(pad)
            targets += [IGNORE] * pad
        return {"input_ids": torch.tensor(input_ids), "position_ids": torch.tensor(position_ids),
                "labels": torch.tensor(labels), "tokens": torch.tensor(tokens)}


class PadToLongest:
    """Collate (input_ids, labels) examples: right-pad each batch to its longest (pad token, attention 0, label
    IGNORE). `tokens` counts the examples' tokens (padding excluded), for the throughput."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
        longest = max(len(ids) for ids, _ in batch)
        pad = [longest - len(ids) for ids, _ in batch]
        return {"input_ids": torch.tensor([ids + [self.pad_id] * p for (ids, _), p in zip(batch, pad)]),
                "attention_mask": torch.tensor([[1] * len(ids) + [0] * p for (ids, _), p in zip(batch, pad)]),
                "labels": torch.tensor([labels + [IGNORE] * p for (_, labels), p in zip(batch, pad)]),
                "tokens": torch.tensor(sum(len(ids) for ids, _ in batch))}


def unpackable(config) -> str | None:
    """Why a model with this config cannot train on packed rows without examples mixing, or None."""
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention not in PACKABLE_ATTENTION:
        return (f"its attention implementation {attention!r} does not keep packed examples apart (supported: "
                f"{', '.join(PACKABLE_ATTENTION)})")
    others = sorted({kind for kind in getattr(config, "layer_types", None) or () if kind not in PACKABLE_LAYERS})
    if others:
        return (f"its {', '.join(others)} layers would mix packed examples (they need per-example kernels); "
                f"train it without --packing")
    return None
