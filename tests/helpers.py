"""Small readers and writers of files that many tests use. Standard library and numpy only, no test
framework: tests/fault_inject.py imports it inside the launched ranks too."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np


def read_metrics(output_dir: Path) -> list[dict]:
    """The records of `output_dir/metrics.jsonl`, one dict a line."""
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def is_png(path: Path) -> bool:
    """Whether `path` is a file that starts as every PNG does (the 8-byte signature)."""
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def snapshot(root: Path) -> dict[str, list]:
    """Every file and folder under `root`: whether a folder, its inode, a file's size, the modification
    time and a file's sha256. Two equal snapshots: nothing was written, replaced, added or removed.
    Lists, not tuples, so that a snapshot written as JSON (tests/fault_inject.py) compares equal."""
    found = {}
    for path in sorted(root.rglob("*")):
        stat = path.stat()
        is_file = path.is_file()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if is_file else None
        found[str(path.relative_to(root))] = [path.is_dir(), stat.st_ino, stat.st_size if is_file else 0,
                                              stat.st_mtime_ns, digest]
    return found


WORDS = "the quick brown fox jumps over lazy dog and cat runs far away from home".split()


def tiny_text(lines: int = 380) -> str:
    """A small text of random lines of 3 to 9 common words, the same every time."""
    rng = random.Random(0)
    return "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) + "\n" for _ in range(lines))


def write_tiny_corpus(path: Path, lines: int = 380) -> Path:
    """`tiny_text` written to `path`: a corpus the language model learns something from in a few steps."""
    path.write_text(tiny_text(lines))
    return path


def random_text(path: Path, size: int, seed: int) -> Path:
    """`size` random lower-case letters, spaces and newlines written to `path`: no 8 bytes of it recur
    by chance, so shared content means a shared sample."""
    rng = np.random.default_rng(seed)
    letters = rng.choice(list(b"abcdefghijklmnopqrstuvwxyz     \n"), size=size).astype(np.uint8)
    path.write_bytes(letters.tobytes())
    return path



def wandb_records(run_dir: Path) -> list:
    """The records of W&B's offline run files under `run_dir/wandb`, in order. wandb 0.31 has no Python reader
    for its `.wandb` files: they are LevelDB-style logs (a 7-byte file header; 32 KiB blocks; each record in
    pieces with a 7-byte header: crc32c, length, type FULL/FIRST/MIDDLE/LAST) of `wandb_internal_pb2.Record`."""
    import struct

    from wandb.proto import wandb_internal_pb2

    records = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, pending = path.read_bytes(), 7, b""  # 7: the file header (":W&B", magic, version)
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # block trailer
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a full record, or the last piece of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                records.append(record)
                pending = b""
    return records


def wandb_history_steps(run_dir: Path) -> list[int]:
    """The steps of the history rows in the W&B offline run files under `run_dir/wandb`, in file order."""
    return [record.history.step.num for record in wandb_records(run_dir)
            if record.WhichOneof("record_type") == "history"]
