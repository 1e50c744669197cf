#!/usr/bin/env python
"""Break each rule of the README's "The rules every template follows" by hand and check that its tests notice.

Every entry of MUTATIONS is one way to break a rule: exact source text of one file and what it is
replaced with (the rest of the repository unchanged). For each, the repository (templates/, common/,
tests/, accelerate_configs/, sweeps/, search/, scripts/) is copied to a temporary folder, the text is replaced there (a
text that is not found exactly once is an error: the list must follow the code), and the tests named
for it run with `python -m pytest -x -q`. They must fail: `caught`; tests that pass mean the rule can
be broken unnoticed: `MISSED`. Before the mutations, all the tests named run once on an unchanged copy
and must pass, or a failure would prove nothing. Tests that fail only because a launched run hung (seen
rarely: a loader worker forked while other threads run can deadlock in CPython 3.11) run once more; a
second hang is an error, never `caught`.

    python scripts/check_rule_tests.py              # every mutation (4-5 minutes on 2 idle cores)
    python scripts/check_rule_tests.py --list       # the mutations, one a line
    python scripts/check_rule_tests.py --only no-set-epoch-image --only clip-after-step
    python scripts/check_rule_tests.py --check      # no tests run: every text still found once, every test id exists

Exit status: 0 when every mutation was caught, 1 when one was missed or its tests could not run
(pytest's own errors, an empty selection), 2 when the unchanged copy fails its tests or the list does
not match the code.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COPIED = ("templates", "common", "tests", "accelerate_configs", "sweeps", "search", "scripts")

TR = "tests/test_training_rules.py::"
DR = "tests/test_distributed_rules.py::"
TD = "tests/test_data.py::"
TC = "tests/test_checkpoint.py::"
TA = "tests/test_accelerator.py::"
IMAGE, LM, FT = "templates/image_classification.py", "templates/language_model.py", "templates/finetune_causal_lm.py"
DATA, CHECKPOINT, TRACKING = "common/data.py", "common/checkpoint.py", "common/tracking.py"
ACCELERATOR, BACKGROUND, EXPORT = "common/accelerator.py", "common/background_save.py", "common/export.py"
ERRORS, OPTIM = "common/errors.py", "common/optim.py"

EPOCH_ORDER = TR + "test_each_epoch_has_the_shuffle_that_seed_and_epoch_fix_also_after_a_resume[{}]"
VAL_ORDER = TR + "test_every_evaluation_sees_each_validation_sample_once_in_order[{}]"
RESUMED = TR + "test_resumed_run_ends_bit_identical_in_process[{}]"
DISJOINT = TR + "test_template_trains_and_evaluates_on_disjoint_samples[{}]"
LOADERS = TR + "test_template_loaders_shuffle_and_drop_only_for_training_and_never_pin_on_cpu[{}]"
MODES = TR + "test_train_and_eval_modes[{}]"
STEP_ORDER = TR + "test_step_order_zero_grad_backward_clip_step[{}]"
CLIPPED = TR + "test_the_optimizer_sees_gradients_clipped_to_grad_clip[{}]"
LOGGED_LOSS = TR + "test_logged_training_loss_is_the_float_mean_of_its_micro_batches[{}]"
NO_GRAPH = TR + "test_no_autograd_graph_survives_the_step[{}]"
NON_FINITE = TR + "test_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint[{}]"
WORKERS = DR + "test_every_loader_worker_on_every_rank_draws_different_numbers[{}]"
MAIN_ONLY = DR + "test_export_and_progress_bar_on_the_main_process_only[{}]"
ONCE = DR + "test_logging_and_printing_happen_once[{}]"
COUNTED = DR + "test_evaluation_counts_every_validation_sample_once[{}]"
LR_SCALED = DR + "test_learning_rate_is_scaled_with_the_world_size_as_asked[{}]"
VAL_LOSS = TR + "test_finetune_validation_loss_is_the_exported_models_mean_over_completion_tokens[{}]"
PINNED = TD + "test_build_loaders_pins_memory_for_training_and_evaluation_on_a_gpu"
KILLS = TC + "test_a_kill_at_any_point_of_saving_publishing_or_deleting_leaves_only_complete_checkpoints"
TF = "tests/test_fault_tolerance.py::"
ONE_RANK_ALONE = TF + "test_a_fault_on_one_rank_alone_stops_every_rank_at_the_same_step_with_the_same_exit_code[{}]"
EXPORT_AFTER_SAVE = TF + "test_the_export_waits_for_the_last_checkpoint_written_in_the_background[{}]"
OTHER_SETTINGS = ("tests/test_resume_policy.py::"
                  "test_every_option_refuses_a_resume_with_another_value_unless_it_may_change[{}]")
image, lm, ft, ft_lora = "image_classification", "language_model", "finetune_causal_lm", "finetune_causal_lm_lora"

TRAIN_STEP = ("            optimizer.zero_grad(set_to_none=True)"
              "  # accelerate makes this a no-op inside an accumulation window\n")
OPTIMIZER_STEP = "                optimizer.step()  # skipped by accelerate until the accumulation window is complete\n"
CLIP = "accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)"
RESEED = "        set_seed(self.seed, device_specific=True)\n"  # CheckpointManager.resume, before it loads
RUN_FILE = "        self._write_run_file()  # only now"
EXPORT_WAIT = "ckpt.wait()  # the last checkpoint is on disk"  # the templates' wait before the export
FLAGS_AGREED = "dist.all_reduce(flags, op=dist.ReduceOp.MAX)"  # PreemptionWatcher.check_step


@dataclass(frozen=True)
class Mutation:
    name: str
    rule: str  # the rule of the README list it breaks
    file: str
    edits: tuple[tuple[str, str], ...]  # (exact text, replacement), applied in order
    tests: tuple[str, ...]  # pytest node ids; a test id without [...] means all its parametrizations


def mutation(name: str, rule: str, file: str, old: str | tuple, new: str | None = None, *, tests) -> Mutation:
    edits = old if new is None else ((old, new),)
    return Mutation(name, rule, file, tuple(edits), tuple([tests] if isinstance(tests, str) else tests))


MUTATIONS = [
    # --- data loaders
    mutation("shuffled-validation", "loaders", DATA,
             "sampler = RandomSampler(dataset, generator=sampler_generator) if train else SequentialSampler(dataset)",
             "sampler = RandomSampler(dataset, generator=sampler_generator)",
             tests=VAL_ORDER.format(lm)),
    mutation("unshuffled-training", "loaders", DATA,
             "sampler = RandomSampler(dataset, generator=sampler_generator) if train else SequentialSampler(dataset)",
             "sampler = SequentialSampler(dataset)",
             tests=EPOCH_ORDER.format(image)),
    mutation("drop-last-validation", "loaders", DATA, "drop_last=train,", "drop_last=True,",
             tests=VAL_ORDER.format(image)),
    mutation("no-drop-last-training", "loaders", DATA, "drop_last=train,", "drop_last=False,",
             tests=EPOCH_ORDER.format(image)),
    mutation("pin-memory-on-cpu", "loaders", DATA, 'pin_memory=device.type == "cuda",', "pin_memory=True,",
             tests=LOADERS.format(image)),
    mutation("no-worker-init-fn", "loaders: workers seeded", DATA,
             ' "worker_init_fn": seed_worker,', "",
             tests=LOADERS.format(lm)),
    mutation("worker-numpy-random-one-seed", "loaders: workers seeded", DATA,
             "worker_seed = torch.initial_seed() % 2**32", "worker_seed = 0",
             tests=WORKERS.format(image)),
    mutation("worker-seeds-same-on-every-rank", "loaders: workers seeded", DATA,
             "seed * 1_000_003 + 7919 * (rank + 1) + (0 if train else 1)",
             "seed * 1_000_003 + 7919 + (0 if train else 1)",
             tests=WORKERS.format(lm)),
    mutation("loaders-given-rank-0", "loaders: workers seeded", DATA,
             "rank=accelerator.process_index,", "rank=0,",
             tests=WORKERS.format(image)),
    mutation("no-set-epoch-image", "loaders: set_epoch", IMAGE,
             "train_loader.set_epoch(epoch)  #", "pass  #",
             tests=EPOCH_ORDER.format(image)),
    mutation("no-set-epoch-lm", "loaders: set_epoch", LM,
             "train_loader.set_epoch(state.epoch)  #", "pass  #",
             tests=EPOCH_ORDER.format(lm)),
    mutation("overlapping-digits-split", "loaders: disjoint splits", IMAGE,
             "return Images(Subset(full, train_idx), ", "return Images(Subset(full, train_idx + val_idx[:20]), ",
             tests=DISJOINT.format("digits")),
    mutation("overlapping-image-folder-split", "loaders: disjoint splits", IMAGE,
             "train_paths, train_labels = [paths[i] for i in train_idx], [labels[i] for i in train_idx]",
             "train_paths, train_labels = list(paths), list(labels)",
             tests=DISJOINT.format("image-folder")),
    mutation("overlapping-text-tail-split", "loaders: disjoint splits", LM,
             "train, val = TokenWindows(data, cfg.block_size, 0, cut), ",
             "train, val = TokenWindows(data, cfg.block_size, 0, cut + 4 * cfg.block_size), ",
             tests=DISJOINT.format("text-file")),
    mutation("text-split-overlapping-by-3-tokens", "loaders: disjoint splits", LM,
             "TokenWindows(data, cfg.block_size, cut, len(data))",
             "TokenWindows(data, cfg.block_size, (cut - 1) // cfg.block_size * cfg.block_size - 2, len(data))",
             tests=DISJOINT.format("text-file")),
    mutation("loaders-built-for-the-cpu-on-a-gpu", "loaders: pin_memory with a GPU", DATA,
             "device=accelerator.device, rank=accelerator.process_index,",
             'device=torch.device("cpu"), rank=accelerator.process_index,',
             tests=PINNED),
    mutation("overlapping-text-folder-split", "loaders: disjoint splits", LM,
             "train = TokenWindows(read_text_files([files[i] for i in train_idx]), cfg.block_size)",
             "train = TokenWindows(read_text_files(files), cfg.block_size)",
             tests=DISJOINT.format("text-folder")),
    # --- the loop
    mutation("no-model-eval", "loop: train/eval modes", IMAGE,
             "    model.eval()\n    total_loss, correct, count = 0.0, 0, 0",
             "    total_loss, correct, count = 0.0, 0, 0",
             tests=MODES.format(image)),
    mutation("no-model-train", "loop: train/eval modes", IMAGE, (
        ("        model.train()\n        train_loader.set_epoch(epoch)", "        train_loader.set_epoch(epoch)"),
        ("    model.train()\n    return {\"val/loss\": total_loss", "    return {\"val/loss\": total_loss"),
    ), tests=MODES.format(image)),
    mutation("no-model-train-after-eval", "loop: train/eval modes", LM,
             "    model.train()\n    return {\"val/loss\": total / (windows",
             "    return {\"val/loss\": total / (windows",
             tests=MODES.format(lm)),
    mutation("zero-grad-keeps-tensors", "loop: zero_grad(set_to_none=True)", IMAGE,
             "optimizer.zero_grad(set_to_none=True)", "optimizer.zero_grad(set_to_none=False)",
             tests=STEP_ORDER.format("1-" + image)),
    mutation("zero-grad-after-step", "loop: zero_grad at the start", LM, (
        (TRAIN_STEP, ""), (OPTIMIZER_STEP, OPTIMIZER_STEP + "                optimizer.zero_grad(set_to_none=True)\n"),
    ), tests=STEP_ORDER.format("1-" + lm)),
    mutation("clip-after-step", "loop: clip before step", IMAGE, (
        (OPTIMIZER_STEP, ""),
        ("                if accelerator.sync_gradients:  # unscales",
         "                optimizer.step()\n                if accelerator.sync_gradients:  # unscales"),
    ), tests=CLIPPED.format("fp32-" + image)),
    mutation("clip-before-unscale", "loop: clip after unscaling", IMAGE,
             CLIP, CLIP.replace("accelerator.clip_grad_norm_", "torch.nn.utils.clip_grad_norm_"),
             tests=CLIPPED.format("fp16-scaler-" + image)),
    mutation("clip-wrong-norm", "loop: clipping", LM, CLIP, CLIP[:-1] + ", norm_type=math.inf)",
             tests=CLIPPED.format("fp32-" + lm)),
    mutation("no-clipping", "loop: clipping", LM, CLIP, CLIP.replace("cfg.grad_clip or math.inf", "math.inf"),
             tests=CLIPPED.format("fp32-" + lm)),
    mutation("loss-accumulated-with-graph", "loop: loss.item()", CHECKPOINT,  # TrainingState.count_micro_batch
             "self.interval_loss_sum += loss.detach()", "self.interval_loss_sum += loss",
             tests=NO_GRAPH.format(lm)),
    mutation("interval-loss-not-restarted", "loop: loss.item()", CHECKPOINT,  # TrainingState.take_interval_loss
             "        self.interval_loss_sum, self.interval_batches, self.interval_targets = 0.0, 0, 0.0\n", "",
             tests=LOGGED_LOSS.format(image)),
    mutation("epoch-not-rolled-over", "loaders: set_epoch", CHECKPOINT,  # TrainingState.count_micro_batch
             "self.epoch, self.batches_in_epoch = self.epoch + 1, 0", "self.batches_in_epoch = 0",
             tests=EPOCH_ORDER.format(lm)),
    mutation("no-accelerator-accumulate", "loop: accelerator.accumulate", IMAGE,
             "            with accelerator.accumulate(model):", "            if True:",
             tests=STEP_ORDER.format("2-" + image)),
    mutation("ft-no-model-train-after-eval", "loop: train/eval modes", FT,
             "        tokens += int(counts.sum().item())\n    model.train()\n",
             "        tokens += int(counts.sum().item())\n",
             tests=MODES.format(ft_lora)),  # LoRA: its dropout stays off for the rest of the run
    mutation("ft-no-zero-grad", "loop: zero_grad at the start", FT, TRAIN_STEP, "",
             tests=STEP_ORDER.format("1-" + ft)),
    mutation("ft-no-clipping", "loop: clipping", FT, "cfg.grad_clip or math.inf)", "math.inf)",
             tests=CLIPPED.format("fp32-" + ft)),
    mutation("ft-loss-accumulated-with-graph", "loop: loss.item()", FT,
             "step_sums += torch.stack([loss.detach(), ", "step_sums += torch.stack([loss, ",
             tests=NO_GRAPH.format(ft)),
    mutation("ft-validation-loss-over-every-token", "evaluation: the loss the template reports", FT,
             '(batch["labels"][:, 1:] != IGNORE).sum(1)', 'batch["attention_mask"][:, 1:].sum(1)',
             tests=VAL_LOSS.format(ft)),
    # --- mixed precision
    mutation("fp16-where-bf16-exists", "mixed precision", "common/accelerator.py",
             'return "bf16" if has_bf16 else "fp16"', 'return "fp16"',
             tests=TA + "test_resolve_mixed_precision"),
    mutation("non-finite-loss-trained-on", "mixed precision: non-finite stops", LM,
             "if not preemption.check_step(grad_norm, ckpt) and accelerator.scaler is None:",
             "if not preemption.check_step(grad_norm, ckpt) and False:",
             tests=NON_FINITE.format(lm)),
    mutation("ft-non-finite-loss-trained-on", "mixed precision: non-finite stops", FT,
             "if not preemption.check_step(grad_norm, ckpt) and accelerator.scaler is None:",
             "if not preemption.check_step(grad_norm, ckpt) and False:",
             tests=NON_FINITE.format(ft)),
    mutation("fp16-overflow-stops-the-run", "mixed precision: fp16 overflow skipped", IMAGE,
             "if not preemption.check_step(grad_norm, ckpt) and accelerator.scaler is None:",
             "if not preemption.check_step(grad_norm, ckpt):",
             tests=TR + "test_fp16_overflow_is_skipped_by_the_scaler_not_fatal[image_classification]"),
    # --- checkpoints
    mutation("rng-reseeded-after-resume", "checkpoints: whole state (RNG)", CHECKPOINT, (
        (RESEED, ""), (RUN_FILE, RESEED + RUN_FILE),
    ), tests=RESUMED.format(image)),
    mutation("scheduler-not-checkpointed", "checkpoints: whole state (scheduler)", LM,
             "model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)",
             "model, optimizer = accelerator.prepare(model, optimizer)",
             tests=RESUMED.format(lm)),
    mutation("data-position-not-used", "checkpoints: whole state (data position)", IMAGE,
             "skip = state.batches_in_epoch  #", "skip = 0  #",
             tests=RESUMED.format(image)),
    mutation("state-not-restored", "checkpoints: whole state (step, epoch, data position, best)", CHECKPOINT,
             "return cls(**{k: v for k, v in meta.items() if k in fields})",  # TrainingState.from_record
             'return cls(step=meta["step"], best_metric=meta.get("best_metric"))',
             tests=RESUMED.format(lm)),
    mutation("keep-last-off-by-one", "checkpoints: keep-last-K", CHECKPOINT,
             "for old in periodic[: -self.keep_last] + best[:-1]:",
             "for old in periodic[: -self.keep_last - 1] + best[:-1]:",
             tests=TC + "test_keep_last_k_periodic_and_best_kept_apart"),
    mutation("best-not-kept-apart", "checkpoints: periodic and best apart", CHECKPOINT,
             'periodic = [p for p in done if p.name.startswith("step_")]',
             "periodic = done",
             tests=TC + "test_keep_last_k_periodic_and_best_kept_apart"),
    mutation("saved-under-the-final-name", "checkpoints: atomic", CHECKPOINT, (
        ('final, tmp = self.dir / name, self.dir / f".tmp-{name}"', "final = tmp = self.dir / name"),
        ("        if final.exists():\n            _remove_checkpoint(final)\n", ""),
    ), tests=KILLS),
    mutation("published-before-progress-json", "checkpoints: atomic", CHECKPOINT, (
        ("        write_json(tmp / PROGRESS_FILE, meta)\n", ""),
        ("        os.replace(tmp, final)\n",
         "        os.replace(tmp, final)\n        write_json(final / PROGRESS_FILE, meta)\n"),
    ), tests=KILLS),
    mutation("background-save-of-live-tensors", "checkpoints: a background save holds the step's state", BACKGROUND,
             "        return _copy_state_dict(state_dict, buffer, non_blocking=self.pin_memory, type_check=False)",
             "        return state_dict",
             tests=(TC + "test_training_goes_on_while_the_save_is_written_and_the_checkpoint_holds_the_step",
                    TC + "test_two_ranks_background_saves_write_what_save_state_writes_and_resume_exactly")),
    mutation("background-failure-not-agreed", "checkpoints: a failed background save ends the run", ACCELERATOR,
             "        flags[2] = checkpoints is not None and checkpoints.write_failed()\n", "",
             tests=TC + "test_a_failed_background_write_ends_the_run_at_the_next_step"),
    mutation("export-before-last-save-image", "checkpoints: export after the last save",
             IMAGE, EXPORT_WAIT, "pass  # the last checkpoint is on disk", tests=EXPORT_AFTER_SAVE.format("image")),
    mutation("export-before-last-save-lm", "checkpoints: export after the last save",
             LM, EXPORT_WAIT, "pass  # the last checkpoint is on disk", tests=EXPORT_AFTER_SAVE.format("lm")),
    mutation("export-before-last-save-ft", "checkpoints: export after the last save",
             FT, EXPORT_WAIT, "pass  # the last checkpoint is on disk", tests=EXPORT_AFTER_SAVE.format("finetune")),
    mutation("deletion-keeps-progress-json", "checkpoints: atomic deletion", CHECKPOINT,
             "    (path / PROGRESS_FILE).unlink(missing_ok=True)\n    fsync_file(path)\n    shutil.rmtree(path)",
             "    shutil.rmtree(path)",
             tests=(TC + "test_a_deletion_cut_short_leaves_no_folder_that_looks_complete", KILLS)),
    mutation("extended-run-keeps-the-old-schedule", "checkpoints: a longer run follows its new schedule", OPTIM,
             '            group["lr"] = lr\n', "",  # follow_new_schedule
             tests=TC + "test_a_longer_run_extends_its_checkpoint_with_the_schedule_of_the_new_length"),
    mutation("status-step-not-moved-by-checkpoints", "status.json: a running run's step is its last checkpoint",
             CHECKPOINT, '                self.on_published(meta["step"])\n', "                pass\n",
             tests=TC + "test_status_step_is_the_last_complete_checkpoint_while_running"),
    mutation("failure-not-recorded-in-status-json", "status.json: every end state recorded", ERRORS,
             "        at_failure(self.failed, stopped=self.end)  # every error that ends main() records itself here\n",
             "",
             tests=TF + "test_status_json_says_how_every_launch_ended[image-1proc]"),
    mutation("status-json-written-by-every-rank", "status.json: the main process alone writes it", ERRORS,
             "        self.enabled = accelerator.is_main_process\n", "        self.enabled = True\n",
             tests=TF + "test_only_the_main_process_writes_status_json[image-ddp]"),
    mutation("learning-rate-may-change-on-resume", "checkpoints: a run resumes only itself", LM,
             '"Peak LR for one process (~6e-4 for GPT-2 sizes).", "(0, inf)")',
             '"Peak LR for one process (~6e-4 for GPT-2 sizes).", "(0, inf)", may_change=True)',
             tests=OTHER_SETTINGS.format(lm)),
    mutation("template-resume-policy-ignored", "checkpoints: a run resumes only itself", CHECKPOINT,
             "may_change=may_change_on_resume(type(cfg))", "may_change=may_change_on_resume(RunOptions)",
             tests=OTHER_SETTINGS.format(lm)),
    mutation("other-settings-not-refused", "checkpoints: a run resumes only itself", CHECKPOINT,
             "    if not differ:\n        return grown\n", "    return grown\n",  # check_settings
             tests=OTHER_SETTINGS.format(image)),
    # --- distributed
    mutation("gather-instead-of-gather-for-metrics", "distributed: gather_for_metrics", IMAGE,
             "accelerator.gather_for_metrics((losses, logits.argmax(-1), labels))",
             "accelerator.gather((losses, logits.argmax(-1), labels))",
             tests=COUNTED.format(image)),
    mutation("evaluation-not-gathered", "distributed: gather_for_metrics", LM,
             "losses = accelerator.gather_for_metrics(losses.view(targets.shape).sum(1))",
             "losses = losses.view(targets.shape).sum(1)",
             tests=COUNTED.format(lm)),
    mutation("metrics-logged-by-every-rank", "distributed: logging on main", TRACKING,
             "self.enabled = accelerator.is_main_process", "self.enabled = True",
             tests=ONCE.format(lm)),
    mutation("printed-by-every-rank", "distributed: logging on main", TRACKING,
             "    if accelerator.is_main_process:\n        tqdm.write(text,", "    if True:\n        tqdm.write(text,",
             tests=ONCE.format(image)),
    mutation("progress-bar-on-every-rank", "distributed: progress bar on main", TRACKING,
             "disable=not accelerator.is_main_process)", "disable=False)",
             tests=MAIN_ONLY.format(image)),
    mutation("export-written-by-every-rank", "distributed: final saves on main", EXPORT,
             '    if accelerator.is_main_process:\n        tmp = path.with_name(f".tmp-{path.name}")',
             '    if True:\n        tmp = path.with_name(f".tmp-{path.name}")',
             tests=MAIN_ONLY.format(lm)),
    mutation("stop-and-finiteness-decided-alone", "loop: ranks agree on stop and finiteness",
             ACCELERATOR, FLAGS_AGREED, "pass",
             tests=ONE_RANK_ALONE.format("signal-rank1-fsdp")),
    mutation("non-finite-gradients-decided-alone", "loop: ranks agree on stop and finiteness", ACCELERATOR, (
        ("        flags[0] = ~torch.isfinite(grad_norm.detach().reshape(()))\n",
         "        flags[0] = here = ~torch.isfinite(grad_norm.detach().reshape(()))\n"),
        ("        return not non_finite\n", "        return not here.item()\n"),
    ), tests=ONE_RANK_ALONE.format("nan-grad-rank1-ddp")),
    mutation("another-ranks-stop-signal-ignored", "loop: ranks agree on stop and finiteness", ACCELERATOR,
             "            self.received = next(signum for signum, rank in _RANK.items() if rank == local)\n",
             "            pass\n",
             tests=ONE_RANK_ALONE.format("signal-rank0-ddp")),
    mutation("lr-scaling-ignores-world-size", "distributed: LR scaling", LM,
             "scale_learning_rate(cfg.learning_rate, accelerator.num_processes, cfg.lr_scaling)",
             "scale_learning_rate(cfg.learning_rate, 1, cfg.lr_scaling)",
             tests=LR_SCALED.format(lm)),
    mutation("lr-scaling-skipped", "distributed: LR scaling", IMAGE,
             "learning_rate = scale_learning_rate(cfg.learning_rate, accelerator.num_processes, cfg.lr_scaling)",
             "learning_rate = cfg.learning_rate",
             tests=LR_SCALED.format(image)),
]


def mutated_text(m: Mutation, root: Path = REPO) -> str:
    """The file's text with the mutation's edits applied; SystemExit(2) if an edit's text is not found exactly once."""
    text = (root / m.file).read_text()
    for old, new in m.edits:
        found = text.count(old)
        if found != 1:
            raise SystemExit(f"error: mutation {m.name}: {found} occurrences of {old!r} in {m.file} "
                             "(exactly 1 expected): update MUTATIONS in scripts/check_rule_tests.py to the code")
        text = text.replace(old, new)
    return text


def copy_repo(target: Path) -> None:
    for name in COPIED:
        shutil.copytree(REPO / name, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def pytest_command(tests) -> list[str]:
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]


def run_tests(root: Path, tests, timeout: float) -> tuple[int, str]:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    try:
        result = subprocess.run(pytest_command(tests), cwd=root, env=env, capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        return -1, f"timed out after {timeout:.0f} s\n{expired.stdout or ''}"
    return result.returncode, result.stdout + result.stderr


def hung(output: str) -> bool:
    """Tests that failed because a launched run hung (tests/test_distributed_rules.py says RUN HUNG), not on a check."""
    return "RUN HUNG" in output or "TimeoutExpired" in output or output.startswith("timed out after")


def first_failure(output: str) -> str:
    match = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    return match.group(1) if match else ""


def collected_ids(tests) -> set[str]:
    files = sorted({test.split("::")[0] for test in tests})
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                            cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: collecting {' '.join(files)} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return {line.strip() for line in result.stdout.splitlines() if "::" in line}


def check(mutations) -> None:
    """Every edit's text is in the code exactly once and changes it; every test id names collected tests."""
    for m in mutations:
        if mutated_text(m) == (REPO / m.file).read_text():
            raise SystemExit(f"error: mutation {m.name} changes nothing")
    names = [m.name for m in mutations]
    if len(names) != len(set(names)):
        raise SystemExit("error: two mutations share a name")
    ids = collected_ids([t for m in mutations for t in m.tests])
    for m in mutations:
        for test in m.tests:
            if test not in ids and not any(i.startswith(test + "[") for i in ids):
                raise SystemExit(f"error: mutation {m.name}: no test {test}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--check", action="store_true", help="check the list against the code and tests, run nothing")
    parser.add_argument("--only", action="append", metavar="NAME", help="run this mutation (repeatable)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unchanged copy's run of the tests")
    parser.add_argument("--verbose", action="store_true", help="show why the tests failed (pytest's E lines)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per pytest run (default 1200)")
    args = parser.parse_args(argv)

    chosen = MUTATIONS
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTATIONS})
        if unknown:
            parser.error(f"unknown mutation {', '.join(unknown)} (see --list)")
        chosen = [m for m in MUTATIONS if m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:38} {m.rule:42} {m.file}")
        return 0
    try:
        check(chosen)
    except SystemExit as error:
        print(error, file=sys.stderr)
        return 2
    if args.check:
        print(f"{len(chosen)} mutations: every text found once, every test collected")
        return 0

    with tempfile.TemporaryDirectory(prefix="rule-mutations-") as scratch:
        if not args.no_baseline:
            baseline = Path(scratch) / "unchanged"
            copy_repo(baseline)
            tests = list(dict.fromkeys(t for m in chosen for t in m.tests))
            print(f"unchanged copy: {len(tests)} test ids ...", flush=True)
            started = time.monotonic()
            code, output = run_tests(baseline, tests, args.timeout * 3)
            if code != 0 and hung(output):
                print("unchanged copy: a run hung; running the tests again", flush=True)
                code, output = run_tests(baseline, tests, args.timeout * 3)
            if code != 0:
                print(output[-5000:])
                print(f"error: the tests fail without any mutation (exit {code}); fix them first", file=sys.stderr)
                return 2
            print(f"unchanged copy: passed in {time.monotonic() - started:.0f} s\n", flush=True)
            shutil.rmtree(baseline)

        print(f"{'mutation':38} {'rule':42} {'result':7} {'time':>5}  first failing test", flush=True)
        results = []
        for m in chosen:
            root = Path(scratch) / m.name
            copy_repo(root)
            (root / m.file).write_text(mutated_text(m, root))
            started = time.monotonic()
            code, output = run_tests(root, m.tests, args.timeout)
            if code != 0 and hung(output):  # a run that hangs proves nothing about the rule: once more
                print(f"{m.name:38} a run hung; running its tests again", flush=True)
                code, output = run_tests(root, m.tests, args.timeout)
            seconds = time.monotonic() - started
            if code == 1 and hung(output):
                code = -2  # failed only by hanging twice: not caught, an error
            result = {1: "caught", 0: "MISSED"}.get(code, "ERROR")
            shown = first_failure(output) if code == 1 else "" if code == 0 else (
                "a run hung, twice" if code == -2 else f"pytest exit {code}")
            print(f"{m.name:38} {m.rule:42} {result:7} {seconds:4.0f}s  {shown}", flush=True)
            if result == "ERROR":
                print("\n".join("    " + line for line in output.strip().splitlines()[-15:]), flush=True)
            elif args.verbose and result == "caught":
                reasons = [line for line in output.splitlines() if line.startswith("E ")][:6]
                print("\n".join("    " + line[:200] for line in reasons), flush=True)
            results.append(result)
            shutil.rmtree(root, ignore_errors=True)
    caught = results.count("caught")
    print(f"\n{caught} of {len(results)} mutations caught" +
          (f"; missed: {results.count('MISSED')}, errors: {results.count('ERROR')}" if caught < len(results) else ""))
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
