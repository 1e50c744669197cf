"""Overhead: each template's own training loop against a plain PyTorch loop written here.

Both loops run in this process, single process on the CPU, with the same model class (imported
from the template), the same data (the template's dataset functions), batch size, steps, seed,
loss, learning-rate schedule, gradient clipping and, for the image template, the template's own
augmentation function (part of the computation, not of the template's machinery). The template
runs through its real `main(argv)` with tracking (wandb, offline) and checkpointing at their
defaults; the plain loop is `torch.optim.AdamW`, a plain `DataLoader` and nothing else.

The two loops run in lockstep: one template step, one plain step, and so on (see Lockstep), so
load from other users of a shared machine hits both alike. Per run, two ratios template/plain:
  window:   throughput over one or more whole checkpoint periods after start-up, evaluation time
            subtracted (the plain loop does not evaluate), checkpoints, logging, progress bar in;
  per step: the median of per-step time ratios over steps with no evaluation or checkpoint.
A third arm runs the plain loop against itself (A/A): the method's own noise floor. Both loops must
reach the same training loss, compared at every step the template logs. Last, extra lockstep runs
time each call of the template's step that differs from the plain loop's (accelerate's wrappers,
the progress bar, the metrics log) to show where the extra time per step goes.

    python bench/overhead.py                 # both templates, ~3 minutes on 2 busy cores
    python bench/overhead.py --quick         # seconds: checks that the script works, measures nothing
    python bench/overhead.py --write-results # also update bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import threading
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

TARGET = 0.97

# What each template runs here, on top of its defaults (model, batch size, tracking, checkpoints).
# Image: digits, 4 epochs; the window is epochs 2-4 (3 epoch ends, each with the default
# evaluation, best and periodic checkpoint).
# Language model: evaluation (with its best and periodic checkpoint) every eval_every_steps / 2
# steps, twice as often as the default, so that a whole checkpoint period fits the time budget
# (conservative: twice the default checkpoint cost per step), and max_steps = log_every_steps +
# that period: the window, from the first log to the end, holds exactly one period. No text
# sample at the end (it would come after the window anyway).
SETUPS = {
    "image_classification": {
        "argv": ["--epochs", "4"],
        "quick": ["--epochs", "2", "--width", "8", "--depth", "1", "--batch_size", "128"],
    },
    "language_model": {
        "argv": ["--sample_tokens", "0"],
        "quick": ["--batch_size", "2", "--block_size", "16", "--n_layer", "1", "--n_embd", "32",
                  "--eval_every_steps", "8", "--log_every_steps", "4", "--eval_batches", "2", "--sample_tokens", "0"],
    },
}


def template_of(setup: str) -> str:
    return setup.split("@")[0]


def full_argv(name: str, module, argv: list[str]) -> list[str]:
    if name != "language_model" or "--max_steps" in argv:
        return argv
    cfg = module.parse_config(module.Config, argv)
    period = max(1, (cfg.eval_every_steps or 2 * cfg.log_every_steps) // 2)
    return [*argv, "--eval_every_steps", str(period), "--max_steps", str(cfg.log_every_steps + period)]


# ------------------------------------------------------------------------------------ lockstep
class Lockstep:
    """Runs the template and the plain loop, each in its own thread, one step each in turn.

    Interleaving step by step means both loops see the same machine: a burst of load from other
    users slows both, not one of them, which run-by-run interleaving cannot promise on a shared
    machine. Only one loop runs at a time; each step is timed by the loop that runs it, from the
    moment it gets the CPU to the end of its step, so the hand-over itself is timed by neither.
    The two loops share torch's global RNG, so each hand-over saves one loop's RNG state and
    restores the other's: dropout and augmentation draw exactly what they would draw alone.
    """

    def __init__(self, probe: "harness.Probe", core: int | None = None):
        self.probe, self.core = probe, core
        self.pinned: set[int] = set()
        self.template_go, self.plain_go = threading.Semaphore(0), threading.Semaphore(0)
        self.ready_event = threading.Event()
        self.plain_state = None
        self.plain_finished = self.aborted = False
        self.error: BaseException | None = None

    # the plain loop's side
    def ready(self) -> None:
        """Set-up done: keep the RNG state the plain loop's steps start from; the template may start."""
        self.plain_state = torch.get_rng_state()
        self.ready_event.set()

    def pin(self) -> None:
        """Both loops on the same core from their first hand-over on (each thread pins itself once).

        Left to the scheduler, each thread tends to stay on the core it last ran on; when another
        user's job shares one of the two cores, a whole run of one loop is slowed and not the
        other's. Pinning comes after start-up, so processes the template starts before its first
        step (the wandb service) keep every core.
        """
        ident = threading.get_ident()
        if self.core is not None and ident not in self.pinned and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {self.core})  # 0: the calling thread
            self.pinned.add(ident)

    def begin(self) -> None:
        self.plain_go.acquire()
        if self.aborted:
            raise SystemExit("aborted: the template run failed")
        self.pin()
        torch.set_rng_state(self.plain_state)
        self.probe.begins.append(time.perf_counter())

    def end(self) -> None:
        self.probe.steps.append(time.perf_counter())
        self.plain_state = torch.get_rng_state()
        self.template_go.release()

    def run_plain(self, loop, *args) -> threading.Thread:
        def target():
            try:
                loop(*args, turn=self)
            except BaseException as error:  # noqa: BLE001 - handed to the main thread
                self.error = error
                self.ready_event.set()
            finally:
                self.plain_finished = True
                self.template_go.release()

        thread = threading.Thread(target=target, name="plain-loop", daemon=True)
        thread.start()
        self.ready_event.wait()
        if self.error is not None:
            raise self.error
        return thread

    # the template's side: called at the end of each of its steps (outside its timing)
    def template_step_done(self) -> None:
        if self.plain_finished:
            return
        state = torch.get_rng_state()
        self.plain_go.release()
        self.template_go.acquire()
        self.pin()
        torch.set_rng_state(state)
        if self.error is not None:
            raise RuntimeError(f"the plain loop failed: {self.error!r}")

    def abort(self) -> None:
        self.aborted = True
        self.plain_go.release()


# ------------------------------------------------------------------------------------ plain loops
def lr_lambda(warmup: int, total: int, min_ratio: float = 0.1):
    """Linear warmup, then cosine decay to 10%: the schedule written out, as a hand-written loop would."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def adamw(model, weight_decay: float, lr: float, **kwargs) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, fused=True, **kwargs)  # as the templates build it (CPU and CUDA)


def shuffled(dataset, batch_size: int, seed: int, epochs: int | None):
    """Batches of a plain DataLoader, a new shuffle each epoch (seed + epoch), epoch after epoch."""
    order = torch.Generator()
    # own generator: iter() leaves the global RNG alone
    loader = DataLoader(dataset, batch_size=batch_size, sampler=RandomSampler(dataset, generator=order),
                        drop_last=True, generator=torch.Generator())
    epoch = 0
    while epochs is None or epoch < epochs:
        order.manual_seed(seed + epoch)
        yield from loader
        epoch += 1


def plain_image(module, argv: list[str], probe: "harness.Probe", turn: Lockstep) -> None:
    cfg = module.parse_config(module.Config, argv)
    seed_all(cfg.seed)
    data = module.load_datasets(cfg)
    train_set, model = data.train, module.build_model(cfg, data)
    total = cfg.epochs * (len(train_set) // cfg.batch_size)
    optimizer = adamw(model, cfg.weight_decay, cfg.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(min(cfg.warmup_steps, total // 2), total))
    batches = shuffled(train_set, cfg.batch_size, cfg.seed, cfg.epochs)
    torch.manual_seed(cfg.seed)  # the dropout and augmentation stream
    model.train()
    turn.ready()
    for _ in range(total):
        turn.begin()
        images, labels = next(batches)
        optimizer.zero_grad(set_to_none=True)
        if cfg.augment:
            images = module.augment(images, cfg.hflip)
        loss = F.cross_entropy(model(images), labels, label_smoothing=cfg.label_smoothing)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        probe.losses.append(loss.item())
        turn.end()


def plain_language_model(module, argv: list[str], probe: "harness.Probe", turn: Lockstep) -> None:
    cfg = module.parse_config(module.Config, argv)
    torch.set_float32_matmul_precision("high")  # as the template (and nanoGPT-style loops) do
    seed_all(cfg.seed)
    corpus = module.load_corpus(cfg)
    model = module.GPT(vocab_size=corpus.vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                       n_embd=cfg.n_embd, dropout=cfg.dropout)
    optimizer = adamw(model, cfg.weight_decay, cfg.learning_rate, betas=(0.9, 0.95))
    warmup_steps = min(cfg.warmup_steps, cfg.max_steps // 2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup_steps, cfg.max_steps))
    batches = shuffled(corpus.train, cfg.batch_size, cfg.seed, None)
    torch.manual_seed(cfg.seed)  # the dropout stream
    model.train()
    turn.ready()
    for _ in range(cfg.max_steps):
        turn.begin()
        inputs, targets = next(batches)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        probe.losses.append(loss.item())
        turn.end()


PLAIN = {"image_classification": plain_image, "language_model": plain_language_model}


# ------------------------------------------------------------------------------------- measuring
def logged_losses(output_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def plain_logged(losses: list[float], steps: list[int]) -> dict[int, float]:
    """The plain loop's per-step losses averaged over the same intervals the template logs (summed in
    float32, as the template sums its detached losses on the device)."""
    out, previous = {}, 0
    for step in steps:
        total = np.float32(0.0)
        for loss in losses[previous:step]:
            total = np.float32(total + np.float32(loss))
        out[step] = float(total) / (step - previous)
        previous = step
    return out


def geometry(name: str, module, argv: list[str]) -> tuple[int, int, int, str]:
    """(first, last) step of the measured window, items per step, unit."""
    cfg = module.parse_config(module.Config, argv)
    if name == "image_classification":
        train_set = module.load_datasets(cfg).train
        per_epoch = len(train_set) // cfg.batch_size
        return per_epoch, cfg.epochs * per_epoch, cfg.batch_size, "images/s"
    first = cfg.log_every_steps if cfg.log_every_steps < cfg.max_steps else max(1, cfg.max_steps // 5)
    return first, cfg.max_steps, cfg.batch_size * cfg.block_size, "tokens/s"


@contextlib.contextmanager
def signal_handlers_skipped():
    """Python installs signal handlers only from the main thread; the template runs in a worker
    thread here, so its preemption handlers (SIGTERM/SIGUSR1) are not installed. Its per-step
    `stop_now()` check still runs."""
    real = signal.signal

    def install(signum, handler):
        if threading.current_thread() is threading.main_thread():
            return real(signum, handler)
        return signal.getsignal(signum)

    signal.signal = install
    try:
        yield
    finally:
        signal.signal = real


@contextlib.contextmanager
def proposed_fix(what_if: str):
    """'cached-lomo-check': accelerate's is_lomo_available() answered once per process, not twice a step."""
    if not what_if:
        yield
        return
    if what_if != "cached-lomo-check":
        raise SystemExit(f"unknown what-if {what_if!r}")
    import functools

    import accelerate.accelerator
    import accelerate.optimizer

    modules = (accelerate.optimizer, accelerate.accelerator)
    originals = [module.is_lomo_available for module in modules]
    for module, original in zip(modules, originals):
        module.is_lomo_available = functools.cache(original)
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module.is_lomo_available = original


class MainTurn:
    """The A/A arm: a second plain loop in the template's place, taking turns with the first."""

    def __init__(self, probe: "harness.Probe", lockstep: Lockstep):
        self.probe, self.lockstep = probe, lockstep

    def ready(self) -> None:
        pass

    def begin(self) -> None:
        self.probe.begins.append(time.perf_counter())

    def end(self) -> None:
        self.probe.steps.append(time.perf_counter())
        self.lockstep.template_step_done()


def measure(name: str, argv: list[str], arms: list[str], repeats: int, workdir: Path, args,
            label: str | None = None) -> dict:
    """`repeats` lockstep runs per arm (a tracker for the template, or "plain" for A/A), arms taking turns."""
    module = harness.load_template(name)
    window_first, last, items, unit = geometry(name, module, argv)
    runs: dict[str, list] = {arm: [] for arm in arms}
    for repeat in range(repeats):
        for arm in arms[repeat % len(arms):] + arms[: repeat % len(arms)]:
            out = workdir / f"{(label or name).replace('@', '-')}-{arm}-{repeat}"
            plain = harness.Probe(begins=[])
            lockstep = Lockstep(plain, core=args.core)
            thread = lockstep.run_plain(PLAIN[name], module, argv, plain)
            outcome: dict = {}

            def first_side():
                try:
                    if arm == "plain":
                        probe = harness.Probe(begins=[])
                        PLAIN[name](module, argv, probe, turn=MainTurn(probe, lockstep))
                    else:
                        tracker, _, what_if = arm.partition("+")
                        # wandb (offline here) is the default
                        extra = [] if tracker == "wandb" else ["--tracker", tracker]
                        with signal_handlers_skipped(), proposed_fix(what_if):
                            probe = harness.run_template(name, [*argv, *extra, "--output_dir", str(out)],
                                                         after_step=lockstep.template_step_done,
                                                         log_path=out.with_suffix(".log"))
                    outcome["probe"] = probe
                except BaseException as error:  # noqa: BLE001 - re-raised below
                    outcome["error"] = error
                finally:
                    lockstep.abort()  # frees the plain loop if this side stopped early

            # Both loops in worker threads: a loop in the main thread ran 3-5% slower than the same loop
            # in a worker thread here (the A/A arm showed it), which would count against the template.
            first = threading.Thread(target=first_side, name="template-loop")
            first.start()
            first.join()
            thread.join()
            for error in (outcome.get("error"), lockstep.error):
                if error is not None:
                    raise error
            main = outcome["probe"]
            t, p = harness.window(main, window_first, last), harness.window(plain, window_first, last)
            if arm == "plain":
                main_losses = plain_logged(main.losses, list(range(1, len(main.losses) + 1)))
            else:
                main_losses = logged_losses(out)
            runs[arm].append({"template": t, "plain": p, "template_losses": main_losses, "plain_losses": plain.losses})
            what = "plain vs plain" if arm == "plain" else f"template (tracker {arm}) vs plain"
            print(f"  {label or name}, {what}, #{repeat}: {t.steps} steps in {t.seconds:.2f}s vs {p.seconds:.2f}s "
                  f"(checkpoints {t.ckpt_seconds:.2f}s in {t.ckpt_count} saves; "
                  f"evaluation {t.eval_seconds:.2f}s subtracted); "
                  f"median step {1000 * t.median_step:.1f} vs {1000 * p.median_step:.1f} ms", flush=True)
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
    return {"first": window_first, "last": last, "items": items, "unit": unit, "runs": runs}


def summarise(name: str, result: dict) -> list[list]:
    rows = []
    unit, items, steps = result["unit"], result["items"], result["last"] - result["first"]
    for arm, runs in result["runs"].items():
        window_ratio = [r["plain"].seconds / r["template"].seconds for r in runs]
        step_ratio = []
        for r in runs:
            steps_side_by_side = zip(r["template"].durations, r["plain"].durations, r["template"].clean)
            pairs = [p / t for t, p, clean in steps_side_by_side if clean]
            step_ratio.append(statistics.median(pairs))
        template_tp = statistics.median(items * steps / r["template"].seconds for r in runs)
        plain_tp = statistics.median(items * steps / r["plain"].seconds for r in runs)
        ckpt = statistics.median(r["template"].ckpt_seconds for r in runs)
        share = statistics.median(r["template"].ckpt_seconds / r["template"].seconds for r in runs)
        diffs, final = [], None
        for r in runs:
            logged = r["template_losses"]
            mine = plain_logged(r["plain_losses"], sorted(logged))
            diffs += [abs(logged[s] - mine[s]) for s in logged]
            final = (logged[max(logged)], mine[max(logged)], max(logged))
        verdict = "" if arm == "plain" else "met" if statistics.median(window_ratio) >= TARGET else "MISSED"
        rows.append([
            name, "plain loop (A/A)" if arm == "plain" else f"template, tracker {arm.replace('+', ', with ')}",
            f"{steps} ({result['first'] + 1}-{result['last']})", f"{template_tp:,.0f} / {plain_tp:,.0f} {unit}",
            f"{harness.spread(window_ratio)} {verdict}".strip(), harness.spread(step_ratio),
            f"{ckpt:.2f}s, {share:.1%} ({runs[0]['template'].ckpt_count} saves)",
            f"{final[0]:.4f} / {final[1]:.4f} (step {final[2]}); max diff {max(diffs):.0e}",
        ])
    return rows


# ---------------------------------------------------------------------------------- attribution
# Where the template's extra time per step goes: (label, template-side call, plain-side call, what is
# compared). "self": the time spent in the accelerate wrapper itself, without the timed calls it
# makes (AdamW.step inside AcceleratedOptimizer.step, Tensor.backward inside accelerator.backward,
# the same compute as the plain loop's, whose noise would drown the difference); "total": the whole
# call on each side.
CALLS = [
    ("optimizer.step: accelerate's wrapper", "accelerate.optimizer:AcceleratedOptimizer.step", None, "self"),
    ("  of which is_lomo_available()", "accelerate.optimizer:is_lomo_available", None, "total"),
    ("optimizer.zero_grad: accelerate's wrapper", "accelerate.optimizer:AcceleratedOptimizer.zero_grad", None, "self"),
    ("backward: accelerate's wrapper", "accelerate:Accelerator.backward", None, "self"),
    ("clip_grad_norm_ (accelerate's vs torch's)", "accelerate:Accelerator.clip_grad_norm_",
     "torch.nn.utils:clip_grad_norm_", "total"),
    ("scheduler.step: accelerate's wrapper", "accelerate.scheduler:AcceleratedScheduler.step", None, "self"),
    ("progress bar update", "tqdm.std:tqdm.update", None, "total"),
    ("metrics log (metrics.jsonl, wandb)", "common.tracking:Tracker.log", None, "total"),
]
NESTED = ["torch.optim:AdamW.step", "torch.optim:AdamW.zero_grad", "torch:Tensor.backward",
          "torch.optim.lr_scheduler:LambdaLR.step"]


@contextlib.contextmanager
def timed_calls(totals: dict):
    """Wrap the CALLS and NESTED targets (module attributes or class methods); add each call's time
    to totals[(thread name, target, "total")] and its own time, without the NESTED calls it makes
    (the compute the plain loop does too), to totals[(thread name, target, "self")]."""
    import functools
    import importlib

    local = threading.local()
    restore = []
    targets = [t for _, ours, theirs, _ in CALLS for t in (ours, theirs) if t] + NESTED
    for target in dict.fromkeys(targets):
        module_name, attr_path = target.split(":")
        owner = importlib.import_module(module_name)
        *parents, attr = attr_path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        own = attr in vars(owner)  # else inherited (AdamW.step is Adam's): restored by deleting ours
        original = getattr(owner, attr)

        def make(original=original, target=target):
            @functools.wraps(original)
            def wrapper(*args, **kwargs):
                stack = local.__dict__.setdefault("stack", [])
                stack.append(0.0)
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    elapsed = time.perf_counter() - start
                    children = stack.pop()
                    if stack and target in NESTED:  # only the plain loop's own compute leaves a wrapper's self time
                        stack[-1] += elapsed
                    thread = threading.current_thread().name
                    for kind, value in (("total", elapsed), ("self", elapsed - children)):
                        totals[(thread, target, kind)] = totals.get((thread, target, kind), 0.0) + value
            return wrapper

        setattr(owner, attr, make())
        restore.append((owner, attr, original, own))
    try:
        yield
    finally:
        for owner, attr, original, own in reversed(restore):
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)


def attribution(setup: str, argv: list[str], repeats: int, workdir: Path, args) -> list[list]:
    """Lockstep runs (tracker none) with the template's per-step calls timed on both sides, in ms per step."""
    name = template_of(setup)
    totals: dict = {}
    with timed_calls(totals):
        result = measure(name, argv, ["none"], repeats, workdir, args, label=f"{setup}-attribution")
    runs = result["runs"]["none"]
    steps = repeats * result["last"]  # every step of every run: the timed calls happen in all of them
    per_step = {key: 1000 * value / steps for key, value in totals.items()}
    rows, extra = [], 0.0
    for label, ours, theirs, kind in CALLS:
        a = per_step.get(("template-loop", ours, kind), 0.0)
        b = per_step.get(("plain-loop", theirs, kind), 0.0) if theirs else 0.0
        if not label.startswith("  "):
            extra += a - b
        rows.append([setup, label, f"{a:.3f}", f"{b:.3f}" if theirs else "-", f"{a - b:+.3f}"])
    gap = statistics.median(1000 * (r["template"].median_step - r["plain"].median_step) for r in runs)
    median_plain = statistics.median(1000 * r["plain"].median_step for r in runs)
    rows.append([setup, "sum of the above", "", "", f"{extra:+.3f} ({extra / median_plain:.1%} of the plain step)"])
    rows.append([setup, "measured: median step, template - plain", "", "", f"{gap:+.3f} ({gap / median_plain:.1%})"])
    return rows


def describe_setup(setup: str, argv: list[str], result: dict) -> str:
    """What ran, for the table's reader: options, model size, work per step, the window."""
    name = template_of(setup)
    module = harness.load_template(name)
    cfg = module.parse_config(module.Config, argv)
    if name == "image_classification":
        params = sum(p.numel() for p in module.build_model(cfg, module.load_datasets(cfg)).parameters())
        work = f"batch {cfg.batch_size} digits (8x8)"
    else:
        model = module.GPT(256, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd)
        params = sum(p.numel() for p in model.parameters())
        work = f"{cfg.batch_size} x {cfg.block_size} tokens a step, {cfg.n_layer} layers, width {cfg.n_embd}"
    arms = [arm for arm in result["runs"] if arm != "plain"] or list(result["runs"])
    ckpts = result["runs"][arms[0]][0]["template"].ckpt_count
    return (f"{setup}: `{' '.join(argv)}`; {params:,} parameters, {work}; "
            f"window steps {result['first'] + 1}-{result['last']} "
            f"with {ckpts} checkpoint saves (template arm)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of: {', '.join(SETUPS)}")
    parser.add_argument("--arms", default="wandb,none,plain",
                        help="what runs against the plain loop: the template with tracker wandb (its default, offline "
                             "here) and/or none, and plain (the plain loop itself: the method's noise floor). A "
                             "tracker arm with '+cached-lomo-check' (e.g. none+cached-lomo-check) runs the template "
                             "with a proposed fix: accelerate's is_lomo_available(), which AcceleratedOptimizer.step "
                             "calls twice a step, cached")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every arm")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for both loops (0: torch's default)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny runs that only check the script works (no meaningful figures)")
    last_core = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    parser.add_argument("--core", type=int, default=last_core,
                        help="the CPU core both loops are pinned to after start-up "
                             "(default: the last one; -1: no pinning)")
    parser.add_argument("--attribution-repeats", type=int, default=1,
                        help="extra lockstep runs per template with the template's per-step calls timed (0: skip)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' output folders (printed)")
    parser.add_argument("--write-results", action="store_true",
                        help="update the overhead section of bench/RESULTS.md")
    args = parser.parse_args(argv)
    if args.core is not None and args.core < 0:
        args.core = None
    harness.set_threads(args.threads)
    info = harness.machine()
    print(harness.describe_machine(info))
    setups = [n for n in args.setups.split(",") if n and not (args.quick and "quick" not in SETUPS[n])]
    arms = [a for a in args.arms.split(",") if a]
    if args.quick:
        arms, args.repeats = ["none"], 1
    workdir = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    rows, described = [], []
    started = time.perf_counter()
    try:
        for setup in setups:
            name = template_of(setup)
            argv_t = full_argv(name, harness.load_template(name), SETUPS[setup]["quick" if args.quick else "argv"])
            print(f"{setup}: {' '.join(argv_t)}", flush=True)
            setup_arms = [a for a in arms if a in SETUPS[setup].get("arms", arms)]
            repeats = min(args.repeats, SETUPS[setup].get("repeats", args.repeats))
            result = measure(name, argv_t, setup_arms, repeats, workdir, args, label=setup)
            described.append(describe_setup(setup, argv_t, result))
            rows += summarise(setup, result)
    finally:
        if args.keep:
            print(f"outputs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    headers = ["template", "against the plain loop", "steps timed", "throughput template / plain",
               "ratio, window: median [min-max]", "ratio, per step: median [min-max]", "checkpoints in window",
               "train loss template / plain"]
    text = harness.table(headers, rows)
    print()
    print(text)
    print(f"\ntarget: the template keeps >= {TARGET:.0%} of the plain loop's throughput (window ratio); "
          f"{args.repeats} interleaved repeats; {time.perf_counter() - started:.0f}s")
    extra = "\n\n" + "\n".join(f"- {line}" for line in described)
    print(extra)
    if args.attribution_repeats:
        rows_a = []
        workdir = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
        try:
            for setup in setups:
                setup_argv = SETUPS[setup]["quick" if args.quick else "argv"]
                argv_t = full_argv(template_of(setup), harness.load_template(template_of(setup)), setup_argv)
                rows_a += attribution(setup, argv_t, 1 if args.quick else args.attribution_repeats, workdir, args)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        table = ("\n\nWhere the template's extra time per step goes: its calls timed inside lockstep runs "
                 "(tracker none), "
                 "ms per optimizer step, against the plain call each replaces:\n\n"
                 + harness.table(["template", "call", "template", "plain", "difference"], rows_a))
        print(table)
        extra += table
    if args.write_results and not args.quick:
        if any("+" in arm for arm in arms):
            harness.write_results("overhead-what-if", "What if: a proposed fix, side by side with today's template",
                                  text + extra + NOTES, info)
        else:
            harness.write_results("overhead", "Overhead: template loop vs a plain PyTorch loop (CPU, 1 process)",
                                  text + extra + NOTES, info)


NOTES = """

- Lockstep: the template's `main()` and the plain loop run in two threads of one process that take
  turns step by step (one runs while the other waits), each step timed by the loop that runs it;
  torch's global RNG state is swapped at each hand-over. Both loops are in worker threads (a loop in
  the main thread ran 3-5% slower than the same loop in a worker thread here), so the template's
  SIGTERM/SIGUSR1 handlers are not installed (Python allows that only in the main thread); its
  per-step preemption check still runs. One intra-op thread per loop; after start-up both loops are
  pinned to the same core (a whole run of one loop on a core another job was using made A/A runs
  differ by up to 15%).
- Window ratio: plain time / template time over the window; evaluation time is subtracted (the
  plain loop does not evaluate); checkpoint saves, metrics.jsonl writes, wandb logging and the
  progress bar stay in. Image: the defaults (a checkpoint at every epoch end). Language model:
  evaluation and checkpoints every eval_every_steps / 2 steps, twice as often as its default. \
Per-step ratio: median over the window's steps (those without evaluation or
  checkpoint) of plain step time / template step time. median [min-max] over the repeats.
- "plain loop (A/A)" puts a second plain loop in the template's place: ratios away from 1.000 there
  are the method's own noise (different tensor placement of two identical models, the machine).
- Attribution: calls timed with wrappers inside separate lockstep runs (not the runs of the main
  table). accelerate's wrappers by their own time (the AdamW step, backward pass and LR update
  they call are the plain loop's compute, timed apart); clip_grad_norm_, a different
  implementation in accelerate, by its whole time on each side. Timed between real training
  steps, calls cost ~3x what they cost in a tight loop (cold caches): is_lomo_available(), ~40 us in
  a loop, took ~140 us a call here.
- Same computation in both: model class, dataset functions and (image) augmentation from the
  template; AdamW with the template's weight-decay groups, its warmup + cosine schedule, gradient
  clipping at 1.0, the same seeds and data order; losses compared at every logged step.
"""


if __name__ == "__main__":
    main()
