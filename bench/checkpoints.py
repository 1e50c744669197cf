"""Checkpoints: the checkpoint manager's save and resume against torch.save / torch.load of the same state.

The state is the language-model template's: its GPT (by default 8 layers, width 384: ~14M
parameters), AdamW with its moment buffers filled by one training step, and the LR scheduler,
all prepared by `common.accelerator.build_accelerator` on one CPU process. Compared, interleaved
(the order rotates every repeat):

  save   CheckpointManager.save(progress): accelerate's save_state (model.safetensors, optimizer.bin,
         scheduler.bin, RNG states) into .tmp-<name>/, progress.json, fsync of every file and folder,
         atomic rename, and pruning to --keep_last (3, the default: from the 4th save on it deletes one)
  vs     torch.save({model, optimizer, scheduler state dicts}) to one file, without fsync
  vs     the same plus what makes it as durable and atomic: fsync of the file, rename, fsync of the folder
  load   CheckpointManager.resume(path): accelerate's load_state into the model, optimizer and
         scheduler, RNG states restored
  vs     torch.load + load_state_dict into the same model, optimizer and scheduler

Every save starts after os.sync(), with no other data waiting to be written (the no-fsync save
would otherwise leave its 170 MB to slow whichever save comes next). Loads read files just written,
so both read from the page cache. Bytes are the files on disk.

    python bench/checkpoints.py                 # ~1 minute
    python bench/checkpoints.py --quick         # seconds: checks the script, measures nothing
    python bench/checkpoints.py --write-results # also update bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

TARGET = 1.5


def build(n_layer: int, n_embd: int, n_head: int, block_size: int):
    from common.accelerator import build_accelerator
    from common.optim import warmup_cosine, weight_decay_groups

    module = harness.load_template("language_model")
    harness.reset_accelerate()
    accelerator = build_accelerator(seed=0)
    torch.manual_seed(0)
    model = module.GPT(vocab_size=256, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))
    scheduler = warmup_cosine(optimizer, 10, 1000)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    tokens = torch.randint(0, 256, (2, block_size + 1))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    accelerator.backward(loss)
    optimizer.step()  # fills AdamW's exp_avg / exp_avg_sq: the optimizer state is twice the model
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return accelerator, model, optimizer, scheduler


def state(model, optimizer, scheduler) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(obj: dict, path: Path, durable: bool) -> None:
    if not durable:
        torch.save(obj, path)
        return
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def torch_load(path: Path, model, optimizer, scheduler) -> None:
    loaded = torch.load(path, weights_only=True)
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])


def disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n_layer", type=int, default=8)
    parser.add_argument("--n_embd", type=int, default=384)
    parser.add_argument("--n_head", type=int, default=6)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9, help="interleaved repeats of every save and load")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder under $TMPDIR)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 repeats: checks the script works")
    parser.add_argument("--write-results", action="store_true",
                        help="update the checkpoints section of bench/RESULTS.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.n_layer, args.n_embd, args.n_head, args.block_size, args.repeats = 1, 32, 2, 16, 2
    harness.set_threads(args.threads)
    info = harness.machine()
    print(harness.describe_machine(info))

    from common.checkpoint import CheckpointManager, TrainingState
    import common.checkpoint as checkpoint_module

    accelerator, model, optimizer, scheduler = build(args.n_layer, args.n_embd, args.n_head, args.block_size)
    n_params = sum(p.numel() for p in model.parameters())
    workdir = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    manager = CheckpointManager(accelerator, workdir / "manager", template="language_model", config={},
                                metric="val/loss", mode="min")
    # Where the manager's save time goes: accelerate's save_state, and the fsync of the folder.
    parts: dict[str, list[float]] = {"save_state": [], "fsync": []}
    real_save_state, real_fsync_tree = accelerator.save_state, checkpoint_module._fsync_tree

    def timed(store, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                store.append(time.perf_counter() - start)
        return wrapper

    accelerator.save_state = timed(parts["save_state"], real_save_state)
    checkpoint_module._fsync_tree = timed(parts["fsync"], real_fsync_tree)
    times: dict[str, list[float]] = {
        k: [] for k in ("manager save", "torch.save", "torch.save + fsync + rename", "manager resume", "torch.load")
    }
    sizes: dict[str, int] = {}
    started = time.perf_counter()
    try:
        saves = list(times)[:3]
        for repeat in range(args.repeats):
            order = saves[repeat % 3:] + saves[: repeat % 3]
            for what in order:
                os.sync()  # start every save with nothing else waiting to be written (outside the timing)
                start = time.perf_counter()
                if what == "manager save":
                    last_checkpoint = manager.save(TrainingState(step=repeat + 1))
                    sizes[what] = disk_bytes(last_checkpoint)
                else:
                    path = workdir / ("plain.pt" if what == "torch.save" else "durable.pt")
                    torch_save(state(model, optimizer, scheduler), path, durable=what != "torch.save")
                    sizes[what] = disk_bytes(path)
                times[what].append(time.perf_counter() - start)
            for what in (["manager resume", "torch.load"] if repeat % 2 == 0 else ["torch.load", "manager resume"]):
                start = time.perf_counter()
                if what == "manager resume":
                    with harness.quiet(None):
                        manager.resume(str(last_checkpoint))
                else:
                    torch_load(workdir / "durable.pt", model, optimizer, scheduler)
                times[what].append(time.perf_counter() - start)
            print(f"  repeat {repeat}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)
    finally:
        accelerator.save_state, checkpoint_module._fsync_tree = real_save_state, real_fsync_tree
        shutil.rmtree(workdir, ignore_errors=True)
        harness.reset_accelerate()

    med = {k: statistics.median(v) for k, v in times.items()}

    def cell(k: str) -> str:
        return f"{med[k]:.3f} [{min(times[k]):.3f}-{max(times[k]):.3f}]"

    save_ratio = med["manager save"] / med["torch.save + fsync + rename"]
    load_ratio = med["manager resume"] / med["torch.load"]
    mb = lambda n: f"{n / 1e6:,.1f} MB"  # noqa: E731
    save_ratio_no_fsync = med["manager save"] / med["torch.save"]
    rows = [
        ["save", cell("manager save"), cell("torch.save + fsync + rename"), cell("torch.save"),
         f"{save_ratio:.2f}x {'met' if save_ratio <= TARGET else 'MISSED'} ({save_ratio_no_fsync:.2f}x vs no fsync)"],
        ["load", cell("manager resume"), cell("torch.load"), "-",
         f"{load_ratio:.2f}x {'met' if load_ratio <= TARGET else 'MISSED'}"],
        ["bytes on disk", mb(sizes["manager save"]), mb(sizes["torch.save + fsync + rename"]), mb(sizes["torch.save"]),
         f"{sizes['manager save'] / sizes['torch.save']:.3f}x"],
    ]
    text = harness.table(["", "CheckpointManager, s", "torch (fsync + rename), s", "torch (no fsync), s",
                          f"ratio (target <= {TARGET}x)"], rows)
    save_state_median, fsync_median = statistics.median(parts["save_state"]), statistics.median(parts["fsync"])
    rest_of_save = med["manager save"] - save_state_median - fsync_median
    detail = (f"\nModel: GPT n_layer {args.n_layer}, n_embd {args.n_embd}, {n_params:,} parameters "
              "(+ AdamW state, scheduler); "
              f"median [min-max] of {args.repeats} interleaved repeats. Of the manager's save (median): "
              f"accelerate save_state {save_state_median:.3f}s, fsync of the folder {fsync_median:.3f}s, "
              f"the rest (progress.json, rename, pruning to 3) {rest_of_save:.3f}s.")
    print()
    print(text)
    print(detail)
    print(f"{time.perf_counter() - started:.0f}s")
    if args.write_results and not args.quick:
        harness.write_results("checkpoints", "Checkpoints: CheckpointManager vs torch.save / torch.load",
                              text + "\n" + detail + NOTES, info)


NOTES = """

- Written to a temporary folder on the machine's root disk (a virtual disk on this VM, so fsync
  times vary); `os.sync()` before every save; loads come from the page cache, for both.
- The fair baseline for save is the durable one (fsync + rename, as the manager does); the one
  without fsync is shown for reference: it returns before the data is on disk.
"""


if __name__ == "__main__":
    main()
