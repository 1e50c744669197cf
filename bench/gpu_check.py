"""The GPU check, one command: five checks through `accelerate launch` on one GPU, one table of results,
under 8 minutes on an H100/H200-class GPU. Run it as `bash bench/gpu_check.sh` (which runs this file).

  1. GPT-2 small (124M), bf16, --compile: tokens/s and MFU against the README's 45% target (bench/gpu.py's
     measurement, launched through bench/launch_entry.py for per-step timing).
  2. The image template on accelerate_configs/single_gpu.yaml: images/s and the final validation accuracy.
  3. The language model with --mixed_precision fp16, the loss-scaler path: did it train, the final loss, and
     the steps the scaler skipped (metrics.jsonl `train/skipped_steps`).
  4. The language model with --compile true --activation_checkpointing true.
  5. Stop and resume: a run stopped by --stop_after_steps, then continued with --resume auto in the same
     folder, against an uninterrupted run of the same settings: the exported model.safetensors compared
     tensor by tensor with torch.equal, and train/loss compared at every step; the exit code and status.json
     of every launch, as the user sees them.

Rows 2-5 launch the templates as a user does: `accelerate launch -q --config_file accelerate_configs/single_gpu.yaml
templates/<name>.py ...` (run as `python -m accelerate.commands.launch`, the same code, with this Python).
Rows 3-5 train a 10.7M-parameter byte-level model on the template's default data, the Python standard library:
big enough to give the GPU work, small enough that their runs take seconds; they check the code paths, row 1
measures speed. Every launch has its own timeout and all share one time budget (--budget), so one hung run
cannot eat the rest: a run past its time is killed with the processes it started, its row fails, the check
goes on. The exit code is 1 if any row failed. Row 1 passes when its run completes: the MFU target is shown in
its figure (met / MISSED), not enforced.

    bash bench/gpu_check.sh                  # on a machine with one GPU
    bash bench/gpu_check.sh --dry-run        # print every command it would run, run nothing
    bash bench/gpu_check.sh --smoke          # the same code path on the CPU (cpu.yaml), tiny models: ~1 minute
    bash bench/gpu_check.sh --write-results  # also replace the gpu_check section of bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402
import harness  # noqa: E402
from common.errors import read_status  # noqa: E402  (harness put the repository on sys.path)

# Rows 3-5 on a GPU: nanoGPT's character-level size (6 layers, width 384, 256 bytes of context).
MID_MODEL = ["--n_layer", "6", "--n_head", "6", "--n_embd", "384", "--block_size", "256", "--batch_size", "64",
             "--learning_rate", "1e-3", "--warmup_steps", "20"]
TINY_MODEL = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--batch_size", "8",
              "--warmup_steps", "2"]
# No W&B, no sample at the end, evaluation (and its checkpoint) only at the last step: seconds saved per run.
LM_QUIET = ["--tracker", "none", "--sample_tokens", "0", "--eval_every_steps", "0"]
# What an exact resume has to survive besides the weights: dropout masks and a gradient-accumulation window.
RESUME_HARD = ["--dropout", "0.1", "--gradient_accumulation_steps", "2", "--log_every_steps", "1"]
MAX_SKIPPED_SHARE = 0.1  # fp16: a scaler that skips more than this share of the steps is not training


@dataclasses.dataclass
class Sizes:
    """Step counts and timeouts (seconds) of one mode. The GPU's add up to about 4-5 minutes (estimated:
    never run on a GPU yet); the timeouts to more than the budget, which bounds the whole."""

    config: str
    model: list[str]
    lm_steps: int
    lm_log_every: int
    image_epochs: int
    resume_steps: int
    timeouts: dict[str, float]
    budget: float
    threads: int  # intra-op threads per launched process; 0: accelerate's default


GPU_SIZES = Sizes("single_gpu.yaml", MID_MODEL, lm_steps=300, lm_log_every=10, image_epochs=10, resume_steps=100,
                  timeouts={"gpt2": 240, "image": 90, "lm": 90, "compiled": 150, "resume": 90}, budget=450, threads=0)
# On 2 shared cores one thread per process: two OpenMP threads made steps several times slower (RESULTS.md).
SMOKE_SIZES = Sizes("cpu.yaml", TINY_MODEL, lm_steps=12, lm_log_every=2, image_epochs=2, resume_steps=8,
                    timeouts={"gpt2": 120, "image": 120, "lm": 120, "compiled": 180, "resume": 120}, budget=600,
                    threads=1)


@dataclasses.dataclass
class Launch:
    """One `accelerate launch` of a row and, once it ran, what the user would see of it."""

    name: str
    config: str
    template: str
    args: list[str]
    timeout: float
    gpt2: dict | None = None  # row 1: bench/gpu.py's planned run, launched through bench/launch_entry.py
    probe_prefix: Path | None = None
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    started: bool = False
    error: str = ""  # why it has no exit code (timed out, not started), or why row 1's run failed
    wall_s: float = 0.0
    result: dict | None = None  # row 1: gpu.analyse's figures
    status: dict | None = None  # its status.json just after it ended (a resume in the same folder rewrites it)

    @property
    def output_dir(self) -> Path:
        return Path(self.args[self.args.index("--output_dir") + 1])

    def command(self) -> str:
        if self.gpt2 is not None:
            return gpu.command_text(self.gpt2, self.probe_prefix)
        return harness.launch_text(self.config, f"templates/{self.template}.py", self.args)

    def seen(self) -> str:
        """Exit code and status.json, as the user sees them."""
        if not self.started:
            return self.error or "not run"
        code = f"exit {self.returncode}" if self.returncode is not None else self.error
        if self.status is None:
            return f"{code}, no status.json"
        # A killed run's status.json still says "running": how a user tells a crash from a clean end.
        reason = f" ({self.status['reason']})" if self.status.get("reason") else ""
        return f"{code}, {self.status['state']} at step {self.status['step']}{reason}"

    def state(self) -> tuple[int | None, str | None, int | None]:
        status = self.status or {}
        return self.returncode, status.get("state"), status.get("step")


@dataclasses.dataclass
class Row:
    """One line of the table: its launches, then the verdict its judge gives from what they left behind."""

    number: int
    what: str
    judge: Callable[[Row, Check], None]  # sets passed and figure from the launches' results
    launches: list[Launch]
    passed: bool = False
    figure: str = ""
    wall_s: float = 0.0


@dataclasses.dataclass
class Check:
    """One run of the check: its mode, folder, time budget and the GPU's peak for MFU."""

    smoke: bool
    sizes: Sizes
    workdir: Path
    deadline: float = 0.0
    peak: float | None = None
    rows: list[Row] = dataclasses.field(default_factory=list)

    def run(self, row: Row, launch: Launch) -> None:
        """Launch it within its own timeout and what is left of the budget; record what came of it."""
        left = self.deadline - time.perf_counter()
        print(f"[{row.number}] {launch.name}: {launch.command()}", flush=True)
        if left < 10:
            launch.error = f"not run: the check's {self.sizes.budget:.0f}s budget was spent"
            print(f"    {launch.error}", flush=True)
            return
        timeout = min(launch.timeout, left)
        before = read_status(launch.output_dir)  # the resume's folder holds the stopped run's status.json
        t0 = time.perf_counter()
        launch.started = True
        if launch.gpt2 is not None:
            launch.result, launch.error = gpu.measure(launch.gpt2, launch.probe_prefix, timeout=timeout,
                                                      threads=self.sizes.threads)
            launch.returncode = 0 if launch.result else None  # gpu.measure has printed its output; error says why
        else:
            try:
                done, _ = harness.launch(launch.config, launch.template, launch.args, probe_prefix=None,
                                         threads=self.sizes.threads, timeout=timeout)
                launch.returncode, launch.stdout, launch.stderr = done.returncode, done.stdout, done.stderr
            except subprocess.TimeoutExpired as error:
                launch.error = f"timed out after {timeout:.0f}s (killed)"
                launch.stdout, launch.stderr = error.output or "", error.stderr or ""
        launch.wall_s = time.perf_counter() - t0
        after = read_status(launch.output_dir)
        launch.status = after if after != before else None  # not rewritten (its pid and time would differ)
        print(f"    {launch.seen()}, {launch.wall_s:.0f}s", flush=True)
        if (launch.returncode not in (0, None) or launch.error) and (launch.stdout or launch.stderr):
            print(launch.stdout[-2000:], launch.stderr[-3000:], sep="\n", flush=True)


# ------------------------------------------------------------------------------------ reading results
def losses(output_dir: Path) -> dict[int, float]:
    """train/loss by step (a resumed run's log holds both sessions; a step logged twice: the later)."""
    return {r["step"]: r["train/loss"] for r in harness.read_metrics(output_dir) if "train/loss" in r}


def last(output_dir: Path, key: str) -> float | int | None:
    """The last logged value of a figure (None if never logged)."""
    values = [r[key] for r in harness.read_metrics(output_dir) if r.get(key) is not None]
    return values[-1] if values else None


def finished(launch: Launch, steps: int | None = None) -> str:
    """'' when the launch exited 0 with status.json 'finished' (at `steps`), else what went wrong."""
    code, state, step = launch.state()
    if code != 0 or state != "finished" or (steps is not None and step != steps):
        return f"{launch.name}: {launch.seen()}"
    return ""


def trained(output_dir: Path) -> tuple[bool, str]:
    """Whether the training loss fell from the first logged value to the last, and those two values."""
    curve = losses(output_dir)
    if len(curve) < 2:
        return False, "no training loss logged"
    first, final = curve[min(curve)], curve[max(curve)]
    return final < first, f"loss {first:.3f} -> {final:.3f}"


# ------------------------------------------------------------------------------------------ the rows
def judge_gpt2(row: Row, check: Check) -> None:
    launch = row.launches[0]
    if launch.result is None:
        row.figure = launch.error or "not run"
        return
    result = launch.result
    utilisation = gpu.mfu(result, check.peak)
    if check.smoke:
        mfu_text = f"MFU {utilisation:.1%} of a made-up 1 TFLOP/s (CPU: no real peak)" if utilisation else ""
    elif utilisation is None:
        mfu_text = "MFU unknown: no peak for this GPU (--peak_tflops)"
    else:
        verdict = "met" if utilisation >= gpu.TARGET_MFU else "MISSED"
        mfu_text = f"MFU {utilisation:.1%} (target {gpu.TARGET_MFU:.0%}: {verdict})"
    row.passed = not finished(launch)
    row.figure = (f"{result['median_rate']:,.0f} tokens/s (median step {result['median_step_ms']:.1f} ms), "
                  f"{mfu_text}; first step {result['first_step_s']:.0f}s")


def judge_image(row: Row, check: Check) -> None:
    launch = row.launches[0]
    out = launch.output_dir
    # From the second epoch: the first holds CUDA start-up, cuDNN autotuning and allocator warm-up.
    rates = [r["images_per_s"] for r in harness.read_metrics(out) if r.get("images_per_s") and r["epoch"] > 1]
    accuracy = last(out, "val/accuracy")
    learned, loss_text = trained(out)
    problem = finished(launch)
    row.passed = not problem and learned
    rate = f"{sorted(rates)[len(rates) // 2]:,.0f} images/s" if rates else "no images/s logged"
    accuracy_text = f"val accuracy {accuracy:.1%}" if accuracy is not None else "no val accuracy"
    row.figure = problem or f"{rate}, {accuracy_text}; trained: {'yes' if learned else 'NO'} ({loss_text})"


def judge_fp16(row: Row, check: Check) -> None:
    launch = row.launches[0]
    out = launch.output_dir
    learned, loss_text = trained(out)
    skipped = last(out, "train/skipped_steps")
    problem = finished(launch, check.sizes.lm_steps)
    if check.smoke:  # common/accelerator.py ignores fp16 on the CPU with a warning: the row says so
        warned = "ignored: training on CPU runs in fp32" in launch.stderr
        precision = "CPU: fp16 ignored, trained in fp32, as the template warns" if warned else "CPU: no warning seen"
        right_precision = warned
    else:
        right_precision = "mixed precision fp16" in launch.stdout  # the template's own line about the run
        precision = "fp16 with a loss scaler" if right_precision else "NOT fp16 (see the run's first line)"
    few_skipped = skipped is not None and skipped <= MAX_SKIPPED_SHARE * check.sizes.lm_steps
    row.passed = not problem and learned and right_precision and few_skipped
    skipped_text = f"{skipped} of {check.sizes.lm_steps}" if skipped is not None else "not logged"
    row.figure = problem or (f"trained: {'yes' if learned else 'NO'}, final {loss_text}; skipped steps {skipped_text}"
                             f"; {precision}")


def judge_compiled(row: Row, check: Check) -> None:
    launch = row.launches[0]
    out = launch.output_dir
    learned, loss_text = trained(out)
    problem = finished(launch, check.sizes.lm_steps)
    rate = gpu.logged(out, "tokens_per_s", check.sizes.lm_log_every)  # after the interval that compiles
    memory = last(out, "peak_memory_gb")
    row.passed = not problem and learned
    rate_text = f"{rate:,.0f} tokens/s" if rate else "no tokens/s logged"
    memory_text = f", peak memory {memory:.2f} GB" if memory is not None else ""
    row.figure = problem or f"trained: {'yes' if learned else 'NO'}, final {loss_text}; {rate_text}{memory_text}"


def compare_weights(a: Path, b: Path) -> tuple[bool, str]:
    """Tensor by tensor with torch.equal: (all equal, what was found)."""
    from safetensors.torch import load_file

    if not (a / "model.safetensors").is_file() or not (b / "model.safetensors").is_file():
        return False, "no model.safetensors to compare"
    first, second = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    if sorted(first) != sorted(second):
        return False, "the exports hold different tensors"
    different = [k for k in first if not first[k].equal(second[k])]
    if not different:
        return True, f"model.safetensors: {len(first)}/{len(first)} tensors torch.equal"
    worst = max((first[k].float() - second[k].float()).abs().max().item() for k in different)
    return False, f"model.safetensors: {len(different)}/{len(first)} tensors differ (max |diff| {worst:.2e})"


def compare_losses(a: Path, b: Path, steps: int) -> tuple[bool, str]:
    first, second = losses(a), losses(b)
    same = [s for s in range(1, steps + 1) if s in first and s in second and first[s] == second[s]]
    text = f"train/loss equal at {len(same)}/{steps} steps"
    if len(same) < steps:
        differ = [s for s in range(1, steps + 1) if s not in same]
        text += f" (first difference at step {differ[0]})"
    return len(same) == steps, text


def judge_resume(row: Row, check: Check) -> None:
    whole, stopped, resumed = row.launches[:3]
    if not all(launch.started for launch in row.launches):
        row.figure = "; ".join(f"{launch.name}: {launch.seen()}" for launch in row.launches)
        return
    steps, stop_at = check.sizes.resume_steps, check.sizes.resume_steps // 2
    problems = [p for p in (finished(whole, steps), finished(resumed, steps)) if p]
    if stopped.state() != (0, "stopped", stop_at):
        problems.append(f"stop: {stopped.seen()}")
    if resumed.returncode == 0 and "resumed from" not in resumed.stdout:
        problems.append("resume: it did not say it resumed from a checkpoint")
    same_weights, weights_text = compare_weights(whole.output_dir, resumed.output_dir)
    same_losses, losses_text = compare_losses(whole.output_dir, resumed.output_dir, steps)
    row.passed = not problems and same_weights and same_losses
    row.figure = f"bit-exact: {'yes' if same_weights and same_losses else 'NO'} ({weights_text}; {losses_text})"
    if not same_weights and not problems:
        # Tell a resume bug from kernels that differ from run to run: the uninterrupted run once more.
        args = list(whole.args)
        args[args.index("--output_dir") + 1] = str(check.workdir / "resume_whole_again")
        again = Launch("whole, again (the weights differed)", whole.config, whole.template, args, whole.timeout)
        row.launches.append(again)
        check.run(row, again)
        repeatable, again_text = compare_weights(whole.output_dir, again.output_dir)
        row.figure += (f"; two uninterrupted runs: {'equal' if repeatable else 'differ too'} ({again_text})"
                       + ("" if repeatable else ": this GPU does not repeat these runs bit for bit, so the "
                          "resume cannot be shown bit-exact here"))
    if problems:
        row.figure = "; ".join(problems) + "; " + row.figure


# -------------------------------------------------------------------------------------------- the plan
def plan(check: Check) -> list[Row]:
    """The five rows and their launches (nothing runs here)."""
    sizes, work = check.sizes, check.workdir
    gpu_args = gpu.build_parser().parse_args(["--tracker", "none", *(["--smoke", "--no-compile"] if check.smoke
                                                                     else [])])
    gpt2 = gpu.plans(gpu_args, work / "tokens", work)[0]
    gpt2["config"] = sizes.config  # smoke: cpu.yaml like every other row (gpu.py's own smoke keeps single_gpu.yaml)
    lm = [*sizes.model, *LM_QUIET]

    def lm_launch(name: str, folder: str, extra: list[str], steps: int, timeout: str) -> Launch:
        args = [*lm, "--max_steps", str(steps), *extra, "--output_dir", str(work / folder)]
        return Launch(name, sizes.config, "language_model", args, sizes.timeouts[timeout])

    log_every = ["--log_every_steps", str(sizes.lm_log_every)]
    image_args = ["--epochs", str(sizes.image_epochs), "--tracker", "none", "--output_dir", str(work / "image")]
    steps, stop_at = sizes.resume_steps, sizes.resume_steps // 2
    gpt2_what = ("GPT-2 small's path, tiny model (smoke: no --compile)" if check.smoke
                 else "GPT-2 small (124M), bf16, --compile: bench/gpu.py's measurement")
    return [
        Row(1, gpt2_what, judge_gpt2,
            [Launch("GPT-2", gpt2["config"], gpt2["template"], gpt2["args"], sizes.timeouts["gpt2"], gpt2=gpt2,
                    probe_prefix=work / "probe_gpt2")]),
        Row(2, f"image template, {sizes.config}", judge_image,
            [Launch("image", sizes.config, "image_classification", image_args, sizes.timeouts["image"])]),
        Row(3, "language model, --mixed_precision fp16 (loss scaler)", judge_fp16,
            [lm_launch("fp16", "lm_fp16", ["--mixed_precision", "fp16", *log_every], sizes.lm_steps, "lm")]),
        Row(4, "language model, --compile true --activation_checkpointing true", judge_compiled,
            [lm_launch("compile + activation checkpointing", "lm_compiled",
                       ["--compile", "true", "--activation_checkpointing", "true", *log_every], sizes.lm_steps,
                       "compiled")]),
        Row(5, f"stop at step {stop_at} (--stop_after_steps), --resume auto to {steps} vs one uninterrupted run",
            judge_resume,
            [lm_launch("whole", "resume_whole", RESUME_HARD, steps, "resume"),
             lm_launch("stop", "resume_split", [*RESUME_HARD, "--stop_after_steps", str(stop_at)], steps, "resume"),
             lm_launch("resume", "resume_split", [*RESUME_HARD, "--resume", "auto"], steps, "resume")]),
    ]


def results_table(check: Check, total_s: float, gpu_name: str | None) -> str:
    rows = [[row.number, row.what, "pass" if row.passed else "FAIL", row.figure,
             "; ".join(f"{launch.name}: {launch.seen()}" if len(row.launches) > 1 else launch.seen()
                       for launch in row.launches), f"{row.wall_s:.0f}"]
            for row in check.rows]
    text = harness.table(["#", "check", "result", "key figure", "launches: exit code, status.json", "wall s"], rows)
    failed = sum(not row.passed for row in check.rows)
    where = gpu_name or "no GPU: smoke run on the CPU (checks the code path, measures nothing)"
    peak = f"{check.peak:g} TFLOP/s" if check.peak else "unknown"
    return (f"{text}\n\n{where}; peak for MFU {peak}; accelerate config {check.sizes.config}; total {total_s:.0f}s "
            f"(budget for the launches {check.sizes.budget:.0f}s); {failed} of {len(check.rows)} rows failed.\n"
            "Row 1 passes when its run completes (the MFU target is in its figure, not enforced); rows 2-4 when "
            "the run exits 0 with status.json 'finished' and its training loss fell; row 5 when every launch ends "
            "as shown (exit 0; stopped, then finished) and the resumed run matches the uninterrupted one: its "
            "exported tensors torch.equal and train/loss equal at every step.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the same code path on the CPU: tiny models, few steps")
    parser.add_argument("--dry-run", action="store_true", help="print every command it would run, run nothing")
    parser.add_argument("--budget", type=float, default=0.0,
                        help="seconds for all the launches together (0: 450 on a GPU, 600 with --smoke)")
    parser.add_argument("--peak_tflops", type=float, default=0.0,
                        help="the GPU's dense bf16 peak for MFU (0: the template's table)")
    parser.add_argument("--workdir", help="keep the runs' folders here (default: a temporary folder, removed at "
                                          "the end unless a row failed)")
    parser.add_argument("--write-results", action="store_true",
                        help="replace the gpu_check section of bench/RESULTS.md (not with --smoke)")
    args = parser.parse_args(argv)
    import torch

    if not (args.smoke or args.dry_run or torch.cuda.is_available()):
        sys.exit("error: no GPU here (torch.cuda.is_available() is False); use --smoke (the same code path on the "
                 "CPU) or --dry-run")
    sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
    if args.budget:
        sizes = dataclasses.replace(sizes, budget=args.budget)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    check = Check(args.smoke, sizes, workdir.resolve())
    check.rows = plan(check)
    if args.dry_run:
        for row in check.rows:
            print(f"# {row.number}. {row.what}")
            for launch in row.launches:
                print(launch.command())
        print("# 5, only if the weights differ: the uninterrupted run once more, to tell a resume bug from a GPU "
              "that does not repeat runs bit for bit")
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    started = time.perf_counter()
    check.deadline = started + sizes.budget
    info = harness.machine()
    print(harness.describe_machine(info), flush=True)
    check.peak = gpu.peak_tflops(argparse.Namespace(peak_tflops=args.peak_tflops, smoke=args.smoke))
    gpu.write_tokens(workdir / "tokens", 400_000 if args.smoke else None)  # row 1's data
    for row in check.rows:
        t0 = time.perf_counter()
        try:
            for launch in list(row.launches):
                check.run(row, launch)
            row.judge(row, check)
        except Exception as error:  # noqa: BLE001 - a bug of the check itself fails its row, not the other four
            traceback.print_exc()
            row.passed, row.figure = False, f"the check itself failed: {error!r}"
        row.wall_s = time.perf_counter() - t0
        print(f"[{row.number}] {'pass' if row.passed else 'FAIL'}: {row.figure}", flush=True)
    text = results_table(check, time.perf_counter() - started, info["gpu"])
    print()
    print(text)
    failed = any(not row.passed for row in check.rows)
    if args.write_results and args.smoke:
        print("--write-results ignored with --smoke: a CPU smoke run is not a GPU result")
    elif args.write_results:
        harness.write_results("gpu_check", "GPU check: five runs through accelerate launch on one GPU", text, info)
    if failed or args.workdir:
        print(f"run folders (metrics.jsonl, status.json, checkpoints) kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
