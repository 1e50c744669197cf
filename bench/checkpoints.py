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

Then the training time a checkpoint costs, at the step (--checkpoint_background false) and in the
background (the default): the same training loop (forward, backward, clip, AdamW step on batches of
random tokens) runs --stall_steps steps with no checkpoint, with a checkpoint every --stall_every steps
written at the step, and the same written in the background (the loop waits for the last one at its
end, so an unfinished write is counted). Runs interleave, the order rotating. Lost time per checkpoint:
the time of the save's step and the next two (where the writer competes with training; a write takes
less than a step) above the run's median step time outside those steps; the run without checkpoints,
read the same way, shows the method's noise. Target: background <= 20% of at the step.

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
STALL_TARGET = 0.2


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


def stall_runs(accelerator, model, optimizer, scheduler, workdir: Path, steps: int, every: int, repeats: int,
               batch: int, block_size: int) -> list[dict]:
    """Per repeat and kind of run (no checkpoint; one every `every` steps at the step; the same in the
    background, waiting for the last write at the end): each step's seconds, and the seconds of each save call."""
    from common.checkpoint import CheckpointManager, TrainingState

    tokens = torch.randint(0, 256, (steps, batch, block_size + 1))
    kinds = ["none", "at the step", "background"]
    repeats_done = []
    for repeat in range(repeats):
        runs = {}
        for kind in kinds[repeat % 3:] + kinds[: repeat % 3]:
            manager = None
            if kind != "none":
                folder = workdir / f"stall-{kind.replace(' ', '-')}-{repeat}"
                manager = CheckpointManager(accelerator, folder, template="language_model", config={},
                                            metric="val/loss", mode="min", background=kind == "background")
            os.sync()
            step_seconds, save_seconds = [], []
            for step in range(1, steps + 1):
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                inputs, targets = tokens[step - 1, :, :-1], tokens[step - 1, :, 1:]
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                if manager is not None and step % every == every // 2:
                    saved = time.perf_counter()
                    manager.save(TrainingState(step=step))
                    save_seconds.append(time.perf_counter() - saved)
                if manager is not None and step == steps:
                    manager.wait()  # a write still running is training time lost too
                step_seconds.append(time.perf_counter() - start)
            runs[kind] = {"steps": step_seconds, "saves": save_seconds}
            if manager is not None:
                shutil.rmtree(manager.output_dir, ignore_errors=True)
        repeats_done.append(runs)
        print(f"  stall repeat {repeat}: " + ", ".join(f"{k} {sum(v['steps']):.3f}s" for k, v in runs.items()),
              flush=True)
    return repeats_done


WINDOW = 3  # steps from a save on that it may slow down: the save's own step and the next (the write takes < 1 step)


def lost_per_checkpoint(run: dict, every: int) -> tuple[float, float]:
    """(seconds lost per checkpoint, of which in the save call): over the steps from each save's step on
    (WINDOW of them), the time above the run's median step time outside those windows. In the run without
    checkpoints the same steps give the method's own noise."""
    steps = run["steps"]
    saved_at = [s for s in range(1, len(steps) + 1) if s % every == every // 2]  # 1-based steps, as in stall_runs
    windows = [range(s - 1, min(s - 1 + WINDOW, len(steps))) for s in saved_at]
    inside = {i for window in windows for i in window}
    baseline = statistics.median(t for i, t in enumerate(steps) if i not in inside)
    lost = [sum(steps[i] - baseline for i in window) for window in windows]
    return statistics.mean(lost), (statistics.mean(run["saves"]) if run["saves"] else 0.0)


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
    parser.add_argument("--stall_steps", type=int, default=30, help="training steps of each stall run")
    parser.add_argument("--stall_every", type=int, default=10, help="a checkpoint every N of those steps")
    parser.add_argument("--stall_batch", type=int, default=1, help="sequences per training step of the stall runs")
    parser.add_argument("--stall_repeats", type=int, default=5, help="interleaved repeats of each stall run")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 repeats: checks the script works")
    parser.add_argument("--write-results", action="store_true",
                        help="update the checkpoints section of bench/RESULTS.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.n_layer, args.n_embd, args.n_head, args.block_size, args.repeats = 1, 32, 2, 16, 2
        args.stall_steps, args.stall_every, args.stall_repeats = 12, 6, 2
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
    real_save_state, real_fsync_tree = accelerator.save_state, checkpoint_module.fsync_tree

    def timed(store, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                store.append(time.perf_counter() - start)
        return wrapper

    accelerator.save_state = timed(parts["save_state"], real_save_state)
    checkpoint_module.fsync_tree = timed(parts["fsync"], real_fsync_tree)
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
        accelerator.save_state, checkpoint_module.fsync_tree = real_save_state, real_fsync_tree
        stall = stall_runs(accelerator, model, optimizer, scheduler, workdir, args.stall_steps, args.stall_every,
                           args.stall_repeats, args.stall_batch, args.block_size)
    finally:
        accelerator.save_state, checkpoint_module.fsync_tree = real_save_state, real_fsync_tree
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
    kinds = ("none", "at the step", "background")
    lost = {kind: [lost_per_checkpoint(runs[kind], args.stall_every) for runs in stall] for kind in kinds}
    lost_med = {kind: statistics.median(total for total, _ in values) for kind, values in lost.items()}
    in_call = {kind: statistics.median(call for _, call in values) for kind, values in lost.items()}
    stall_ratio = max(lost_med["background"], 0.0) / lost_med["at the step"] if lost_med["at the step"] > 0 else None
    verdict = "-" if stall_ratio is None else f"{stall_ratio:.2f}x {'met' if stall_ratio <= STALL_TARGET else 'MISSED'}"
    step_ms = 1000 * statistics.median(statistics.median(runs["none"]["steps"]) for runs in stall)
    label = {"none": "none (the method's noise)", "at the step": "at the step", "background": "in the background"}
    stall_rows = [[label[kind], f"{1000 * lost_med[kind]:.1f} [{1000 * min(t for t, _ in lost[kind]):.1f} to "
                                f"{1000 * max(t for t, _ in lost[kind]):.1f}]",
                   "-" if kind == "none" else f"{1000 * in_call[kind]:.1f}",
                   "-" if kind == "none" else f"{1000 * (lost_med[kind] - in_call[kind]):.1f}",
                   verdict if kind == "background" else "-"]
                  for kind in kinds]
    stall_text = harness.table(["checkpoints written", "training time lost per checkpoint, ms",
                                "of it in the save call, ms", f"of it in the next {WINDOW - 1} steps, ms",
                                f"background / at the step (target <= {STALL_TARGET}x)"], stall_rows)
    saves_per_run = len(stall[0]["background"]["saves"])
    stall_detail = (f"\nSame model and optimizer; {args.stall_steps} training steps a run of {args.stall_batch} "
                    f"sequence(s) of {args.block_size} tokens (median step {step_ms:.0f} ms without checkpoints), "
                    f"{saves_per_run} checkpoints a run; lost: the time of the save's step and the {WINDOW - 1} "
                    "after it above the run's median step time elsewhere; median [min to max] over "
                    f"{args.stall_repeats} repeats, the runs interleaved.")
    print()
    print(text)
    print(detail)
    print()
    print(stall_text)
    print(stall_detail)
    print(f"{time.perf_counter() - started:.0f}s")
    if args.write_results and not args.quick:
        harness.write_results("checkpoints", "Checkpoints: CheckpointManager vs torch.save / torch.load",
                              text + "\n" + detail + "\n\nTraining time lost to checkpoints, at the step vs in the "
                              "background:\n\n" + stall_text + "\n" + stall_detail + NOTES, info)


NOTES = """

- Written to a temporary folder on the machine's root disk (a virtual disk on this VM, so fsync
  times vary); `os.sync()` before every save; loads come from the page cache, for both.
- The fair baseline for save is the durable one (fsync + rename, as the manager does); the one
  without fsync is shown for reference: it returns before the data is on disk.
- Lost time in the background: on the CPU (here) what the writing thread takes from training (the two share
  2 CPU cores and Python's lock) and any wait of the next optimizer step for the write, which writes the state
  in place; on a GPU the copy to host memory at the step instead (there the training thread mostly waits for
  the GPU).
"""


if __name__ == "__main__":
    main()
