"""bench/ scripts in their tiny modes, so they keep working as the templates change: each one runs
the real templates end to end and prints its table. No timing is asserted (these are not benchmarks)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, clean_env

SCRIPTS = ["overhead", "data_loading", "checkpoints", "scaling", "gpu", "gpu_check", "finetune_loading",
           "finetune_packing", "finetune_vs_trl", "memory_phases", "finetune_phases"]


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    assert "usage:" in run(f"bench/{script}.py", "--help").stdout


def test_overhead_quick():
    out = run("bench/overhead.py", "--quick", "--attribution-repeats", "1").stdout
    assert "against the plain loop" in out and "template, tracker none" in out
    # Template and plain loop compute the same thing: the losses they log agree exactly.
    for line in out.splitlines():
        if line.startswith("| image_classification ") or line.startswith("| language_model "):
            if "max diff" in line:
                assert "max diff 0e+00" in line, line
    assert "is_lomo_available" in out  # the attribution ran


def test_data_loading_quick():
    out = run("bench/data_loading.py", "--quick").stdout
    for case in ("image, digits (default)", "image, PNG folder", "language, stdlib (default)", "language, token files"):
        assert f"| {case}" in out, case


def test_checkpoints_quick():
    out = run("bench/checkpoints.py", "--quick").stdout
    assert "| save " in out and "| load " in out and "| bytes on disk" in out


def test_scaling_quick():
    out = run("bench/scaling.py", "--quick").stdout
    assert "Model size" in out and "2 DDP ranks" in out


def test_finetune_loading_quick():
    out = run("bench/finetune_loading.py", "--quick", "--dtype", "fp32").stdout
    rows = [line for line in out.splitlines() if line.startswith("| fp32 ")]
    assert len(rows) == 4 and "one copy" in rows[0] and "naive" in rows[3], out  # 2 ways x 2 ranks measured


def test_memory_phases_quick():
    out = run("bench/memory_phases.py", "--quick").stdout
    phases = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")][2:]
    for phase in ("start-up (imports)", "model load", "evaluation before training", "training steps"):
        assert phase in phases, out  # marked (a phase shorter than the 50 ms between samples too: as it began)
    assert "peak RSS" in out and "MiB in '" in out, out


def test_finetune_packing_quick():
    out = run("bench/finetune_packing.py", "--quick").stdout
    rows = {line.split("|")[1].strip(): line.split("|")[2:] for line in out.splitlines() if line.startswith("| pa")}
    assert sorted(rows) == ["packed", "padded"], out
    # The packed arm takes as many rows a step as hold the padded arm's examples: about the same tokens a step
    padded, packed = (float(rows[arm][0].strip().replace(",", "")) for arm in ("padded", "packed"))
    assert 0.75 < packed / padded < 1.33, out
    assert "packed / padded, 1 rounds: steady non-padding tokens/s" in out


def options(command: str) -> dict[str, str]:
    """--name value pairs of a printed command line."""
    import shlex

    words = shlex.split(command)
    return {w[2:]: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--") and
            not words[i + 1].startswith("--")}


def test_finetune_phases_quick_times_every_phase_of_a_launched_run():
    out = run("bench/finetune_phases.py", "--quick", timeout=400).stdout
    phases = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")][1:]
    assert phases[:4] == ["launcher", "imports", "setup", "evaluation before training"], out
    assert {"sample answers", "checkpoint written", "export", "sample", "**whole command**"} <= set(phases), out


def test_finetune_vs_trl_dry_run_gives_both_tools_the_same_training():
    """Without TRL installed: the arms' commands train the same steps, batch, schedule, optimizer and precision,
    and TRL's settings follow the template's own defaults (change one there and this fails)."""
    import inspect

    from conftest import load_template

    from common.optim import warmup_cosine

    lines = run("bench/finetune_vs_trl.py", "--dry-run", "--padding-free").stdout.splitlines()
    assert len(lines) == 5 and all(line.startswith("accelerate launch -q --config_file accelerate_configs/cpu.yaml ")
                                   for line in lines), lines
    ours_padded, theirs_padded, ours_packed, theirs_packed, padding_free = map(options, lines)
    assert all(" templates/finetune_causal_lm.py " in lines[i] for i in (0, 2))
    assert all(" bench/trl_sft.py " in lines[i] for i in (1, 3, 4))
    template = load_template("finetune_causal_lm")
    config = template.Config()
    assert "betas=(0.9, 0.95)" in inspect.getsource(template.main)
    min_ratio = inspect.signature(warmup_cosine).parameters["min_ratio"].default
    for ours, theirs in ((ours_padded, theirs_padded), (ours_packed, theirs_packed), (ours_padded, padding_free)):
        for mine, trl in (("max_steps", "max_steps"), ("batch_size", "per_device_train_batch_size"),
                          ("learning_rate", "learning_rate"), ("warmup_steps", "warmup_steps"), ("seed", "seed"),
                          ("data_path", "dataset_name"), ("model", "model_name_or_path")):
            assert ours[mine] == theirs[trl], (mine, ours, theirs)
        assert theirs["max_grad_norm"] == str(config.grad_clip) and theirs["weight_decay"] == str(config.weight_decay)
        assert (theirs["adam_beta1"], theirs["adam_beta2"]) == ("0.9", "0.95")
        assert theirs["lr_scheduler_type"] == "cosine_with_min_lr"
        assert theirs["lr_scheduler_kwargs"] == f'{{"min_lr_rate": {min_ratio}}}'
        assert theirs["bf16"] == "false"  # the template trains in fp32 on the CPU
        assert theirs["gradient_checkpointing"] == str(config.gradient_checkpointing).lower()
        assert theirs["report_to"] == "none" and ours["tracker"] == "none"
    assert ours_padded["max_length"] == theirs_padded["max_length"] == ours_packed["max_length"] == \
        theirs_packed["max_length"]
    assert ours_packed["packing"] == theirs_packed["packing"] == "true" and "packing" not in ours_padded
    assert padding_free["padding_free"] == "true" and "packing" not in padding_free


def test_finetune_vs_trl_real_model_dry_run_shares_the_training_and_keeps_each_tools_defaults():
    """The real-model arms (no model or TRL needed for --dry-run): full and LoRA, padded and packed, each template
    arm beside its TRL arm with the same steps, batch, length, learning rate, schedule, seed and LoRA; the template
    keeps its defaults for evaluation, sample answers and checkpoints, and TRL its own (no evaluation, no save
    options), as a user runs each."""
    from conftest import load_template

    lines = run("bench/finetune_vs_trl.py", "--dry-run", "--model", "smollm2").stdout.splitlines()
    assert len(lines) == 8, lines
    config = load_template("finetune_causal_lm").Config()
    tunings = set()
    for ours_line, theirs_line in zip(lines[::2], lines[1::2]):
        assert " templates/finetune_causal_lm.py " in ours_line and " bench/trl_sft.py " in theirs_line
        ours, theirs = options(ours_line), options(theirs_line)
        for mine, trl in (("max_steps", "max_steps"), ("batch_size", "per_device_train_batch_size"),
                          ("learning_rate", "learning_rate"), ("warmup_steps", "warmup_steps"), ("seed", "seed"),
                          ("max_length", "max_length"), ("data_path", "dataset_name"),
                          ("model", "model_name_or_path"), ("log_every_steps", "logging_steps")):
            assert ours[mine] == theirs[trl], (mine, ours, theirs)
        assert ours.get("packing") == theirs.get("packing"), (ours, theirs)
        lora = "lora_r" in ours
        tunings.add("lora" if lora else "full")
        assert (theirs.get("use_peft") == "true") == lora
        if lora:
            for name in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"):
                assert ours[name] == theirs[name], name
            assert float(ours["learning_rate"]) > float(lines[0].split("--learning_rate ")[1].split()[0])
        assert theirs["bf16"] == "false" and theirs["gradient_checkpointing"] == str(
            config.gradient_checkpointing).lower()
        assert (theirs["adam_beta1"], theirs["adam_beta2"], theirs["max_grad_norm"]) == ("0.9", "0.95",
                                                                                       str(config.grad_clip))
        # each tool's defaults around training: nothing set that a user would not type
        assert not {"eval_every_steps", "eval_samples", "sample_tokens", "checkpoint_every_steps",
                    "checkpoint_background", "export_from"} & set(ours), ours
        assert not {"eval_strategy", "eval_steps", "save_strategy", "save_steps"} & set(theirs), theirs
    assert tunings == {"full", "lora"}
    assert sum("--packing true" in line for line in lines) == 4


def test_gpu_dry_run_builds_the_commands():
    out = run("bench/gpu.py", "--dry-run").stdout.splitlines()
    assert len(out) == 3
    lm = out[0]
    for part in ("single_gpu.yaml", "language_model", "--n_layer 12", "--n_embd 768", "--block_size 1024",
                 "--vocab_size 50304", "--mixed_precision bf16", "--compile true"):
        assert part in lm, part
    assert all("image_classification" in line for line in out[1:])


def test_gpu_smoke_runs_the_same_path_on_cpu():
    out = run("bench/gpu.py", "--smoke", "--no-compile", "--tracker", "none").stdout
    assert "language model (smoke: tiny)" in out and "image, digits, batch 64" in out and "FAILED" not in out


def run_gpu_check(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """bench/gpu_check.sh as a user runs it, with this Python (the wrapper takes $PYTHON)."""
    return subprocess.run(["bash", "bench/gpu_check.sh", *args], cwd=REPO, env=clean_env(PYTHON=sys.executable),
                          capture_output=True, text=True, timeout=timeout)


def test_gpu_check_dry_run_prints_the_five_checks_commands():
    done = run_gpu_check("--dry-run")
    assert done.returncode == 0, done.stderr[-3000:]
    commands = [line for line in done.stdout.splitlines() if not line.startswith("#")]
    assert len(commands) == 7, done.stdout  # GPT-2, image, fp16, compiled, and whole / stop / resume
    assert all(c.startswith("accelerate launch -q --config_file accelerate_configs/single_gpu.yaml ") for c in commands)
    gpt2, image, fp16, compiled, whole, stop, resume = commands
    for part in ("bench/launch_entry.py language_model", "--n_layer 12", "--n_embd 768", "--mixed_precision bf16",
                 "--compile true", "--tracker none"):
        assert part in gpt2, part
    assert " templates/image_classification.py " in image
    lm = [fp16, compiled, whole, stop, resume]
    assert all(" templates/language_model.py " in c and "--tracker none" in c for c in lm)  # the user path, no W&B
    assert "--mixed_precision fp16" in fp16 and "--compile" not in fp16
    assert "--compile true" in compiled and "--activation_checkpointing true" in compiled
    assert "--stop_after_steps 50" in stop and "--max_steps 100" in stop and "--resume" not in stop
    assert "--resume auto" in resume and "--stop_after_steps" not in resume

    def output_dir(command: str) -> str:
        return command.split("--output_dir ", 1)[1].split()[0]

    assert output_dir(stop) == output_dir(resume) != output_dir(whole)  # continued in the stopped run's folder
    assert stop.replace(" --stop_after_steps 50", "") == resume.replace(" --resume auto", "")  # same settings
    assert stop.replace(" --stop_after_steps 50", "").replace(output_dir(stop), output_dir(whole)) == whole


def test_gpu_check_without_a_gpu_says_so_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = run_gpu_check(timeout=60)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.strip().startswith("error: no GPU here") and len(done.stderr.strip().splitlines()) == 1


def test_gpu_check_smoke_runs_every_check_on_cpu():
    """The same code path as on a GPU (cpu.yaml, tiny models): every row passes, the table is printed and the
    stop-and-resume row is bit-exact."""
    done = run_gpu_check("--smoke")
    assert done.returncode == 0, f"{done.stdout[-5000:]}\n{done.stderr[-3000:]}"
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| ")}
    assert sorted(rows) == ["#", "1", "2", "3", "4", "5"], done.stdout
    assert all("| pass " in rows[n] for n in "12345"), done.stdout
    assert "images/s" in rows["2"] and "tokens/s" in rows["1"] and "tokens/s" in rows["4"]
    assert "skipped steps 0 of" in rows["3"] and "fp16 ignored, trained in fp32" in rows["3"]
    assert "bit-exact: yes (model.safetensors:" in rows["5"] and "train/loss equal at 8/8 steps" in rows["5"]
    assert "stop: exit 0, stopped at step 4 (--stop_after_steps); resume: exit 0, finished at step 8" in rows["5"]
    assert "0 of 5 rows failed" in done.stdout


def test_write_results_replaces_only_its_section(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "bench"))
    import harness

    monkeypatch.setattr(harness, "RESULTS", tmp_path / "RESULTS.md")
    info = {"cores": 2, "cpu": "x", "gpu": None, "torch": "t", "accelerate": "a", "python": "p", "load": 0.0,
            "threads": 1}
    harness.write_results("one", "One", "first", info)
    harness.write_results("two", "Two", "second", info)
    harness.write_results("one", "One", "third", info)
    text = (tmp_path / "RESULTS.md").read_text()
    assert "third" in text and "second" in text and "first" not in text
    assert text.index("## One") < text.index("## Two")
