"""Shared pieces of the benchmarks: load a template, run its real `main()` with timing probes,
summarise step times, describe the machine, print tables and update bench/RESULTS.md.

The probes only wrap names the template module looks up at run time (`progress_bar`, `evaluate`,
`CheckpointManager`, `start_run`); the training loop that runs is the template's own code.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
RESULTS = BENCH / "RESULTS.md"
CONFIGS = REPO / "accelerate_configs"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from search.sweep import free_port  # noqa: E402  (the one copy; search/ imports no torch)

TEMPLATES = ("image_classification", "language_model")


# --------------------------------------------------------------------------------- templates
def load_template(name: str):
    """Import templates/<name>.py as a module, as tests/conftest.py does (same module name)."""
    module_name = f"template_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, REPO / "templates" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def reset_accelerate() -> None:
    """accelerate keeps process-wide singletons; every in-process run starts from a clean slate."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def teardown_wandb() -> None:
    """Stop the wandb service a template run started, so it does not share the CPU with the next run."""
    if "wandb" in sys.modules:
        with contextlib.suppress(Exception):
            sys.modules["wandb"].teardown()


def set_threads(threads: int) -> None:
    """Intra-op threads of this process (and of the processes it launches, through OMP_NUM_THREADS)."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


# ------------------------------------------------------------------------------------ probes
@dataclass
class Probe:
    """Timestamps (time.perf_counter) of what a template run does.

    steps:  the end of each optimizer step (the template's `bar.update(1)`, once per step)
    begins: the start of each step's timing: the end of the previous step (after any lockstep
            hand-over, see overhead.py); the first step's start is unknown (NaN: start-up)
    evals:  (start, end) of each `evaluate(...)` call
    ckpts:  (start, end, what) of each CheckpointManager save / save_if_due / resume
    waits:  (start, end) of each `next()` on the training loader, as the training loop sees it
    """

    steps: list[float] = field(default_factory=list)
    begins: list[float] = field(default_factory=lambda: [math.nan])
    evals: list[tuple[float, float]] = field(default_factory=list)
    ckpts: list[tuple[float, float, str]] = field(default_factory=list)
    waits: list[tuple[float, float]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # plain loops only: the loss of each step
    info: dict = field(default_factory=dict)
    loaders: list = field(default_factory=list, repr=False)  # prepared loaders, to stop their workers after a run

    def stop_loader_workers(self) -> None:
        """Shut down persistent loader workers now, rather than whenever their loader is collected
        (in-process runs keep going; left to interpreter exit they could block it)."""
        for loader in self.loaders:
            base = getattr(loader, "base_dataloader", loader)
            iterator = getattr(base, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
            if iterator is not None:
                base._iterator = None
        self.loaders.clear()

    def to_json(self) -> dict:
        return {"steps": self.steps, "begins": self.begins, "evals": self.evals, "ckpts": self.ckpts,
                "waits": self.waits, "losses": self.losses, "info": self.info}

    @classmethod
    def from_json(cls, data: dict) -> "Probe":
        return cls(steps=data["steps"], begins=[math.nan if b is None else b for b in data["begins"]],
                   evals=[tuple(e) for e in data["evals"]], ckpts=[tuple(c) for c in data["ckpts"]],
                   waits=[tuple(w) for w in data["waits"]], losses=data.get("losses", []), info=data.get("info", {}))


class _TimedLoader:
    """Stands in for the prepared training loader: times each `next()` the loop makes, delegates the rest."""

    def __init__(self, loader, probe: Probe):
        self._loader, self._probe = loader, probe

    def __iter__(self):
        iterator = iter(self._loader)
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self._probe.waits.append((start, time.perf_counter()))
            yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)


@contextlib.contextmanager
def probed(module, probe: Probe, time_loader: bool = False, after_step=None):
    """Wrap the template module's hooks for the duration of one `main()` call.

    `after_step`, if given, is called at the end of every optimizer step, outside the timed part
    (overhead.py hands the CPU to the plain loop there).
    """
    needed = ("progress_bar", "evaluate", "CheckpointManager", "start_run")
    missing = [name for name in needed if not hasattr(module, name)]
    if missing:
        raise RuntimeError(f"{module.__file__} no longer has {', '.join(missing)}: the benchmark probes need updating")
    originals = {name: getattr(module, name) for name in ("progress_bar", "evaluate", "CheckpointManager", "start_run")}

    def progress_bar(*args, **kwargs):
        probe.info["loop_start"] = time.perf_counter()  # the bar is made just before the training loop
        bar = originals["progress_bar"](*args, **kwargs)
        update = bar.update

        def timed_update(n=1):
            probe.steps.append(time.perf_counter())
            if after_step is not None:
                after_step()
            probe.begins.append(time.perf_counter())
            return update(n)  # the bar's own update is timed, as part of the next step

        bar.update = timed_update
        return bar

    def evaluate(*args, **kwargs):
        start = time.perf_counter()
        try:
            return originals["evaluate"](*args, **kwargs)
        finally:
            probe.evals.append((start, time.perf_counter()))

    class CheckpointManager(originals["CheckpointManager"]):
        def _timed(self, what, method, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                probe.ckpts.append((start, time.perf_counter(), what))

        def save(self, *args, **kwargs):
            return self._timed("save", super().save, *args, **kwargs)

        def save_if_due(self, *args, **kwargs):  # called every step: only a call that saved counts
            start = time.perf_counter()
            saved = super().save_if_due(*args, **kwargs)
            if saved is not None:
                probe.ckpts.append((start, time.perf_counter(), "save_if_due"))
            return saved

        def resume(self, *args, **kwargs):
            return self._timed("resume", super().resume, *args, **kwargs)

    def start_run(*args, **kwargs):
        import torch

        accelerator, preemption = originals["start_run"](*args, **kwargs)
        prepare = accelerator.prepare
        seen = {"train": False}

        def recording_prepare(*objects, **kw):
            results = prepare(*objects, **kw)
            single = len(objects) == 1
            results = [results] if single else list(results)
            for i, (given, got) in enumerate(zip(objects, results)):
                if not isinstance(given, torch.utils.data.DataLoader):
                    continue
                probe.loaders.append(got)
                # The templates prepare (train_loader, val_loader) first: the first loader is training.
                if not seen["train"]:
                    seen["train"] = True
                    probe.info.update(num_workers=given.num_workers, pin_memory=given.pin_memory,
                                      prefetch_factor=given.prefetch_factor,
                                      persistent_workers=given.persistent_workers)
                    if time_loader:
                        results[i] = _TimedLoader(got, probe)
            return results[0] if single else tuple(results)

        accelerator.prepare = recording_prepare
        probe.info["num_processes"] = accelerator.num_processes
        return accelerator, preemption

    wrappers = {"progress_bar": progress_bar, "evaluate": evaluate, "CheckpointManager": CheckpointManager,
                "start_run": start_run}
    for name, wrapper in wrappers.items():
        setattr(module, name, wrapper)
    try:
        yield probe
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


@contextlib.contextmanager
def quiet(log_path: Path | None):
    """Send a run's prints and progress bar to a log file (or nowhere) instead of the terminal."""
    target = open(log_path, "a") if log_path else open(os.devnull, "w")
    try:
        with contextlib.redirect_stdout(target), contextlib.redirect_stderr(target):
            yield
    finally:
        target.close()


def run_template(name: str, argv: list[str], *, time_loader: bool = False, log_path: Path | None = None,
                 after_step=None) -> Probe:
    """Run templates/<name>.py's own `main(argv)` in this process, probed; return the timings."""
    module = load_template(name)
    probe = Probe()
    reset_accelerate()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        with quiet(log_path), probed(module, probe, time_loader=time_loader, after_step=after_step):
            probe.info["result"] = module.main(argv)
    except SystemExit as error:  # with_exit_codes turns bad input into exit code 2
        raise RuntimeError(f"{name} {' '.join(argv)} exited with {error.code}; see {log_path}") from None
    finally:
        probe.stop_loader_workers()
        teardown_wandb()
        reset_accelerate()
    return probe


# --------------------------------------------------------------------------------- summaries
def _overlap(start: float, end: float, intervals) -> float:
    return sum(max(0.0, min(end, e[1]) - max(start, e[0])) for e in intervals)


@dataclass
class Window:
    """Steps first+1 .. last (1-based) of a run: their own time, without what happened between them."""

    first: int
    last: int
    seconds: float  # the steps' time minus evaluation (which the plain loop does not do)
    eval_seconds: float
    ckpt_seconds: float
    ckpt_count: int
    durations: list[float]  # per step, evaluation subtracted
    clean: list[bool]  # per step: no evaluation and no checkpoint in it

    @property
    def steps(self) -> int:
        return self.last - self.first

    @property
    def median_step(self) -> float:
        clean = [d for d, c in zip(self.durations, self.clean) if c]
        return statistics.median(clean) if clean else math.nan


def window(probe: Probe, first: int, last: int) -> Window:
    """Steps first+1 .. last; `first` >= 1 leaves start-up (everything up to the first step's end) out."""
    if last > len(probe.steps) or first < 1 or last <= first:
        raise ValueError(f"window {first}..{last} outside the {len(probe.steps)} steps recorded")
    durations, clean, evals, ckpts, count = [], [], 0.0, 0.0, 0
    for i in range(first, last):  # 0-based index of step i+1
        begin, end = probe.begins[i], probe.steps[i]
        in_eval = _overlap(begin, end, probe.evals)
        in_ckpt = [c for c in probe.ckpts if c[0] >= begin and c[1] <= end]
        durations.append(end - begin - in_eval)
        clean.append(in_eval == 0 and not in_ckpt)
        evals += in_eval
        ckpts += sum(c[1] - c[0] for c in in_ckpt)
        count += len(in_ckpt)
    return Window(first, last, sum(durations), evals, ckpts, count, durations, clean)


def spread(values: list[float]) -> str:
    """median [min-max] of a list of ratios/values, for tables."""
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


# ------------------------------------------------------------------------------------- machine
def machine() -> dict:
    import torch

    cpu_model = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    import accelerate

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {"cores": cores, "cpu": cpu_model, "gpu": gpu, "torch": torch.__version__,
            "accelerate": accelerate.__version__, "python": platform.python_version(), "load": load,
            "threads": torch.get_num_threads()}


def describe_machine(info: dict) -> str:
    gpu = info["gpu"] or "no GPU"
    return (f"{info['cores']} cores ({info['cpu']}), {gpu}; torch {info['torch']}, accelerate {info['accelerate']}, "
            f"Python {info['python']}; {info['threads']} intra-op thread(s); load average {info['load']:.1f} at start "
            f"(shared machine)")


def command_line() -> str:
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(REPO)
    return "python " + " ".join(shlex.quote(a) for a in [str(script), *sys.argv[1:]])


# --------------------------------------------------------------------------------------- output
def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table (readable as plain text too)."""
    cells = [[str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_results(section: str, title: str, body: str, info: dict) -> None:
    """Replace (or append) the section between `<!-- bench:section -->` markers in bench/RESULTS.md."""
    begin, end = f"<!-- bench:{section} begin -->", f"<!-- bench:{section} end -->"
    stamp = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    block = (f"{begin}\n## {title}\n\n"
             f"Measured {stamp} on {describe_machine(info)}.\n\n"
             f"```bash\n{command_line()}\n```\n\n{body.strip()}\n{end}")
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)
    print(f"wrote the {section} section of {RESULTS}")


def dump(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1))


# --------------------------------------------------------------------------- launched runs
ENTRY = BENCH / "launch_entry.py"


def clean_env(threads: int, **extra: str) -> dict[str, str]:
    """The environment of a launched run: offline W&B, no rank or accelerate variables leaking in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "ACCELERATE_", "FSDP_"))}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"})
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra)
    return env


def launch_text(config: str, script: str, args: list[str]) -> str:
    """A launch as a user types it; launch() runs the same with this Python, a free port and its thread count."""
    return shlex.join(["accelerate", "launch", "-q", "--config_file", f"accelerate_configs/{config}", script, *args])


def run_killable(command: list[str], *, cwd: Path, env: dict, timeout: float,
                 memory: "TreeMemory | None" = None) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, timeout=timeout), except that a timeout (or a
    Ctrl-C) kills the whole process group: `accelerate launch` starts the training process as its own child,
    which killing the launcher alone would leave running, holding the GPU the next run needs. With `memory`, its
    sampler watches the command's process tree from start to exit."""
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        if memory is not None:
            memory.start(process.pid)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except BaseException as error:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the group of the process started here, nothing else
            stdout, stderr = process.communicate()
            if isinstance(error, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr) from None
            raise
        finally:
            if memory is not None:
                memory.stop()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


class TreeMemory:
    """Peak resident memory of a process and all its descendants (Linux /proc), sampled in a thread every
    `interval` s: `peak` is the largest sum of their RSS seen at one sample (a sampled figure: a peak shorter
    than the interval can be missed), `peak_process` the largest single process's own high-water mark (VmHWM,
    kept by the kernel: exact, but only for that process), as last read while it ran."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.peak, self.peak_process = interval, 0, 0
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._done = None
        self._thread = None

    def _tree(self, pid: int) -> list[int]:
        pids, todo = [], [pid]
        while todo:  # /proc/<pid>/task/<tid>/children: the children of each thread (Linux 3.5+)
            current = todo.pop()
            pids.append(current)
            with contextlib.suppress(OSError):
                for task in os.listdir(f"/proc/{current}/task"):
                    with contextlib.suppress(OSError), open(f"/proc/{current}/task/{task}/children") as file:
                        todo += [int(child) for child in file.read().split()]
        return pids

    def _sample(self, pid: int) -> None:
        total = 0
        for member in self._tree(pid):
            # a process may exit between the listing and the reading (a zombie has no VmHWM line): it counts 0
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{member}/statm") as file:
                    total += int(file.read().split()[1]) * self._page
                with open(f"/proc/{member}/status") as file:
                    hwm = [line.split()[1] for line in file if line.startswith("VmHWM:")]
                self.peak_process = max(self.peak_process, int(hwm[0]) * 1024 if hwm else 0)
        self.peak = max(self.peak, total)

    def start(self, pid: int) -> None:
        import threading

        self._done = threading.Event()

        def loop():
            while not self._done.wait(self.interval):
                self._sample(pid)

        self._sample(pid)
        self._thread = threading.Thread(target=loop, name="tree-memory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._done.set()
            self._thread.join()


def launch(config: str, template: str, args: list[str], *, probe_prefix: Path | None, num_processes: int | None = None,
           threads: int = 1, timeout: float = 600, time_loader: bool = False, env: dict | None = None):
    """`accelerate launch --config_file accelerate_configs/<config> bench/launch_entry.py <template> ...`:
    the template's own main() in real launched processes, each rank writing its probe to
    <probe_prefix>.rank<N>.json. Returns (completed process, probes by rank). With probe_prefix None,
    templates/<template>.py itself is launched, exactly as a user would (no probes: an empty dict).
    A run past `timeout` is killed with its children and raises subprocess.TimeoutExpired."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "-q", "--config_file", str(CONFIGS / config),
               "--main_process_port", str(free_port())]
    if num_processes is not None:
        command += ["--num_processes", str(num_processes)]
    if threads > 0:
        command += ["--num_cpu_threads_per_process", str(threads)]
    if probe_prefix is None:
        command += [str(REPO / "templates" / f"{template}.py"), *args]
    else:
        command += [str(ENTRY), template, str(probe_prefix), *(["--time-loader"] if time_loader else []), "--", *args]
    done = run_killable(command, cwd=REPO, env=env or clean_env(threads), timeout=timeout)
    probes = {}
    if probe_prefix is not None:
        for path in sorted(probe_prefix.parent.glob(f"{probe_prefix.name}.rank*.json")):
            rank = int(path.name.rsplit(".rank", 1)[1].split(".")[0])
            probes[rank] = Probe.from_json(json.loads(path.read_text()))
    return done, probes


def read_metrics(output_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl (none if it has not written one)."""
    path = output_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def flops_per_token(model, seq_len: int) -> float:
    """The language template's own FLOPs count (its signature has changed once: with or without seq_len)."""
    import inspect

    method = model.flops_per_token
    return method(seq_len) if inspect.signature(method).parameters else method()


# ------------------------------------------------------------------------- fine-tuning runs
def mixed_length_task(count: int, seed: int, max_repeats: int = 12) -> list[dict]:
    """Prompt/completion pairs of mixed lengths: reverse a short word and write it 1..max_repeats times
    (the prompt says how many), so completions run from one word to a dozen and a padded batch is
    mostly padding beside its longest example."""
    import random
    import string

    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        word = "".join(rng.choice(string.ascii_lowercase[:8]) for _ in range(rng.randint(3, 6)))
        repeats = rng.randint(1, max_repeats)
        answer = " ".join([word[::-1]] * repeats)
        examples.append({"prompt": f"reverse {word} x{repeats} =", "completion": f" {answer}"})
    return examples


def write_finetune_task(folder: Path, *, hidden: int, layers: int, train: int, val: int) -> tuple[Path, Path]:
    """scripts/make_tiny_model.py's model (hidden x layers) and a folder of the mixed-length task as
    train.jsonl + validation.jsonl (the split names both the template and `datasets` read from file names).
    Returns (model folder, data folder)."""
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # save_pretrained's bar, in the middle of the bench's table
    model_dir, data_dir = folder / "model", folder / "data"
    tiny.make_tiny_model(model_dir, hidden_size=hidden, layers=layers)
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, count, seed in (("train", train, 0), ("validation", val, 1)):
        lines = [json.dumps(example) for example in mixed_length_task(count, seed)]
        (data_dir / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return model_dir, data_dir


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steady_rate(intervals: list[tuple[float, float]], skip: int = 1) -> float:
    """Items per second over (items, seconds) log intervals, the first `skip` left out (start-up: the first
    steps of a run are slower). Total over total, not a mean of rates."""
    kept = intervals[skip:] or intervals
    return sum(items for items, _ in kept) / sum(seconds for _, seconds in kept)


def template_intervals(records: list[dict]) -> list[tuple[float, float]]:
    """(non-padding tokens, seconds) of each log interval of the fine-tuning template's metrics.jsonl: its own
    Throughput counts the tokens (padding excluded) and the time since the previous log, evaluation left out."""
    intervals, previous = [], 0
    for record in records:
        if "tokens_per_s" in record:
            seconds = record["time/step_ms"] * (record["step"] - previous) / 1000
            intervals.append((record["tokens_per_s"] * seconds, seconds))
            previous = record["step"]
    return intervals


def completion_loss(model_dir: Path, tokenizer_dir: Path, examples: list[dict]) -> float:
    """Validation loss per completion token of an exported model (fp32, no accelerate; a LoRA adapter on the model
    of `tokenizer_dir`): each example alone (no padding), the prompt's tokens not counted, the completion's counted
    (with EOS; chat: the end of turn): the one evaluator for every arm, whatever trained it."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = load_export(model_dir, tokenizer_dir)
    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            prompt, completion = prompt_and_completion_ids(tokenizer, example)
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1].float()
            total += F.cross_entropy(logits, torch.tensor(completion), reduction="sum").item()
            count += len(completion)
    return total / count


def rows_for_examples(model_dir: Path, data_dir: Path, examples_per_step: int, max_length: int) -> tuple[int, float]:
    """How many packed rows of `max_length` tokens hold about `examples_per_step` training examples, as the
    template packs them (common.data.pack, best fit decreasing), so a packed run takes steps of the same examples
    and tokens as a padded one of that batch: (rows per step, examples per row)."""
    from transformers import AutoTokenizer

    from common.data import pack

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = read_jsonl(data_dir / "train.jsonl")
    lengths = [sum(map(len, prompt_and_completion_ids(tokenizer, e))) for e in examples]
    per_row = len(examples) / len(pack(lengths, max_length))
    return max(1, round(examples_per_step / per_row)), per_row


# ------------------------------------------------------------------ a real model: SmolLM2 from its GGUF
def gguf_to_folder(gguf: Path, folder: Path) -> Path:
    """A plain Hugging Face folder (fp32 safetensors, tokenizer, chat template) from a GGUF file, which transformers
    dequantizes to fp32 but refuses to save as such ("quantized with gguf and is not serializable"): the same
    weights in a fresh model built from the config without its quantization_config. Both tools of a side by
    side then load the same folder, in the same time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):  # the GGUF reader's own bars
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    del loaded
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def addition_chats(count: int, seed: int, terms: tuple[int, int] = (2, 5)) -> list[dict]:
    """Chat examples in TRL's conversational prompt/completion columns: the user asks for the sum of 2-5 numbers
    of 1-2 digits, the assistant answers with the number only (the lengths vary with the terms, so padded batches
    carry some padding and packing has something to save)."""
    import random

    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        numbers = [rng.randint(1, 99) for _ in range(rng.randint(*terms))]
        question = f"What is {' + '.join(map(str, numbers))}? Reply with the number only."
        examples.append({"prompt": [{"role": "user", "content": question}],
                         "completion": [{"role": "assistant", "content": str(sum(numbers))}]})
    return examples


def write_chat_task(folder: Path, *, train: int, val: int) -> Path:
    """addition_chats as train.jsonl + validation.jsonl in `folder` (the split names both the template and
    `datasets` read from the file names)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, count, seed in (("train", train, 0), ("validation", val, 1)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in addition_chats(count, seed)))
    return folder


def prompt_and_completion_ids(tokenizer, example: dict) -> tuple[list[int], list[int]]:
    """An example's prompt tokens and the tokens the loss counts. Plain prompt/completion: the prompt (with BOS if
    the tokenizer adds one), then the completion and EOS. Conversational: the prompt messages rendered with the
    generation prompt, then what the chat template renders after them for the completion (end of turn included),
    each part tokenized alone, as both tools split them."""
    if isinstance(example["prompt"], str):
        return (tokenizer(example["prompt"])["input_ids"],
                tokenizer(example["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    context = tokenizer.apply_chat_template(example["prompt"], tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(example["prompt"] + example["completion"], tokenize=False)
    if not whole.startswith(context):
        raise ValueError(f"the chat template does not render the completion after its prompt: {whole!r}")
    return (tokenizer(context, add_special_tokens=False)["input_ids"],
            tokenizer(whole[len(context):], add_special_tokens=False)["input_ids"])


def load_export(export: Path, base: Path):
    """An exported model in fp32 for evaluation: a full model folder, or a LoRA adapter on the base model `base`."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Loading weights", between the bench's lines
    if (export / "adapter_config.json").is_file():
        from peft import PeftModel

        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        return PeftModel.from_pretrained(model, export).eval()
    return AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
