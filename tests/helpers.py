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


def wandb_history_steps(output_dir: Path) -> list[int]:
    """The steps of the history rows in the W&B offline run files under `output_dir/wandb`, in file order.

    wandb 0.31 has no Python reader for its `.wandb` files: they are LevelDB logs (a 7-byte file header,
    32 KiB blocks, each record in chunks with a 7-byte header: crc32c, length, type FULL/FIRST/MIDDLE/LAST)
    of `wandb_internal_pb2.Record` messages."""
    from wandb.proto import wandb_internal_pb2

    block, steps = 32768, []
    for path in sorted(output_dir.glob("wandb/*run-*/run-*.wandb")):
        data, position, pending = path.read_bytes(), 7, b""
        while position + 7 <= len(data):
            if block - position % block < 7:  # a block's tail too short for a header is padding
                position += block - position % block
                continue
            length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
            chunk = data[position + 7:position + 7 + length]
            position += 7 + length
            if kind in (2, 3):  # FIRST, MIDDLE: more follows
                pending = (pending if kind == 3 else b"") + chunk
                continue
            payload, pending = (pending + chunk if kind == 4 else chunk), b""
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(payload)
                if record.WhichOneof("record_type") == "history":
                    steps.append(record.history.step.num)
    return steps
