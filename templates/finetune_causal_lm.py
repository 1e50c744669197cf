"""Fine-tune a pretrained Hugging Face causal LM (full or LoRA) on prompt/completion, chat or text data.

    python scripts/make_tiny_model.py runs/tiny --data runs/reverse.jsonl          # offline demo model + task
    accelerate launch -q --config_file accelerate_configs/cpu.yaml templates/finetune_causal_lm.py \
        --model runs/tiny --data_path runs/reverse.jsonl --learning_rate 3e-3 --max_steps 150
    accelerate launch -q --config_file accelerate_configs/fsdp.yaml --num_processes 8 \
        --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer templates/finetune_causal_lm.py \
        --model meta-llama/Llama-3.2-1B-Instruct --data_path chats.jsonl --lora_r 16

Data (`--data_path`): a JSONL, JSON, parquet or CSV file, a folder of them, a `save_to_disk` folder or a Hub
dataset id, in TRL's columns (`prompt`/`completion`, chat `messages` rendered by the tokenizer's chat template,
or `text`), or plain text (a .txt file or a folder of them); the data's `validation` split if it has one. The
loss counts only completion / assistant tokens, each assistant turn in the context the model writes it in
(`text`: every token), every target token of a step weighing the same whatever its micro-batch and rank.
Batches are padded per batch, or with --packing hold whole examples packed into rows. Under FSDP rank 0 alone
reads the weights; every rank builds the model on the meta device, shards it and receives its shard by
broadcast, so a machine holds one full copy while loading. Copy this file plus `common/` into your project.
"""

from __future__ import annotations

import logging
import math
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent  # the common/ beside this file, else beside templates/; never one further up
OURS = HERE / "common" if (HERE / "common").is_dir() else HERE.parent / "common"
sys.path.insert(0, str(OURS.parent))
# A monorepo's program importing this file may have imported a `common` of its own: set aside, handed back below.
THEIRS = {name: sys.modules.pop(name) for name, module in list(sys.modules.items()) if name.split(".")[0] == "common"
          and OURS not in Path(getattr(module, "__file__", None) or "/").resolve().parents}

# ruff: noqa: E402 (the imports below need the sys.path line above)
import common
from common.accelerator import Throughput, end_run, release_process_group, start_run
from common.checkpoint import CheckpointManager
from common.config import RunOptions, _did_you_mean, option, parse_config
from common.data import (RECORD_KEYS, DataSource, PackedCollate, PackedExamples, PadToLongest, Rows, build_loaders,
                         split_by_key, unpackable)
from common.errors import NonFiniteError, RunStatus, UsageError, with_exit_codes
from common.export import export_pretrained
from common.optim import (OptimOptions, average_over_targets, fused_adamw_on, scale_learning_rate, warmup_cosine,
                          weight_decay_groups)
from common.pretrained import (answer_probes, check_lora_targets, enable_gradient_checkpointing, from_pretrained_call,
                               generate, keep_only_trained_in_checkpoints, load_once_per_machine, load_pretrained,
                               load_tokenizer_and_config, render_chat, target_token_losses)
from common.tracking import Tracker, progress_bar, say

common.hand_back(THEIRS, imported=__name__ != "__main__")

# accelerate warns at every checkpoint that it stored a tied lm_head.weight once; loading re-ties it.
logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)
IGNORE = -100  # the label of a token the loss skips (prompt, system, padding)


@dataclass
class Config(OptimOptions, RunOptions):
    """Fine-tune a pretrained causal LM from the Hub or a local folder: full fine-tuning or LoRA."""

    model: str = option("HuggingFaceTB/SmolLM2-135M-Instruct", "Hub id, local folder or .gguf file of a causal LM.")
    data_path: str | None = option(None, "JSONL/JSON/parquet/CSV file or folder, save_to_disk folder or Hub dataset "
                                         "id (columns prompt/completion, messages or text), or .txt text.")
    data_config: str = option("", "Configuration (load_dataset's name) of a Hub dataset or a folder of data files.")
    data_split: str = option("train", "Split to train on.")
    data_val_split: str = option("", "Split to validate on; '': 'validation' if the data has it, else "
                                     "--val_fraction of the training split.")
    val_fraction: float = option(0.1, "Records held out for validation, by a stable hash of each (data without a "
                                      "validation split).", "(0, 1)")
    max_length: int = option(512, "Tokens per example; a longer example is refused with its line (or row).",
                             "[2, inf)")
    max_steps: int = option(200, "Optimizer steps to train for.", "[1, 99999999]")  # checkpoint names: 8 digits
    eval_every_steps: int = option(50, "Validate (and checkpoint) every N optimizer steps; 0: only at the end.",
                                   "[0, inf)", may_change=True)
    batch_size: int = option(8, "Examples per process, per micro-batch (with --packing: rows).", "[1, inf)")
    packing: bool = option(False, "Pack training examples into rows of up to --max_length tokens: no compute on "
                                  "padding, no attention across examples (SDPA, eager, flex, flash attention).")
    learning_rate: float = option(2e-5, "Peak LR for one process (full: ~2e-5; LoRA: ~2e-4).", "(0, inf)")
    weight_decay: float = option(0.0, "AdamW weight decay (matrices only).", "[0, inf)")
    warmup_steps: int = option(10, "Linear warmup before the cosine decay.", "[0, inf)")
    lora_r: int = option(0, "LoRA rank; 0: full fine-tuning of every weight.", "[0, inf)")
    lora_alpha: float = option(16.0, "LoRA scale numerator (the update is scaled by alpha / r).", "(0, inf)")
    lora_dropout: float = option(0.05, "Dropout on the LoRA branch.", "[0, 1)")
    lora_target_modules: list[str] = option(["all-linear"], "Module names LoRA adapts, e.g. [q_proj, v_proj].")
    merge_lora: bool = option(False, "Export the model with the adapter merged in, instead of the adapter alone.",
                              may_change=True)
    gradient_checkpointing: bool = option(False, "Recompute each layer's activations in backward: less memory.",
                                          may_change=True)
    compile: bool = option(False, "torch.compile each decoder layer.", may_change=True)
    prompt: str = option("", "Prompt of the sample at the end (chat data: the user message); default: a "
                             "validation example's.", may_change=True)
    eval_samples: int = option(4, "Validation prompts answered greedily at each evaluation: logged (samples.jsonl, "
                                  "W&B table), with their exact-match rate on prompt/completion data.", "[0, inf)",
                               may_change=True)
    early_stopping_patience: int = option(0, "End the run (and export) after N evaluations in a row without a "
                                             "better val/loss; 0: never.", "[0, inf)")
    export_from: str = option("best", "The weights the export holds: best (the checkpoint of the best val/loss) or "
                                      "last (the last step's).", ("best", "last"), may_change=True)
    sample_tokens: int = option(32, "Tokens to generate (greedy) at the end (0: no sample).", "[0, inf)",
                                may_change=True)
    num_workers: int = option(0, "Loader workers per process (tokenized data is in memory: 0 is fine).", "[0, 128]",
                              may_change=True)
    output_dir: str = option("runs/finetune_causal_lm", "Checkpoints, metrics, status.json and the export go here.")
    wandb_project: str = option("finetune-causal-lm-template",
                                "The run's W&B project, MLflow experiment and trackio project.")

    def __post_init__(self):
        super().__post_init__()
        if self.early_stopping_patience and not self.eval_every_steps:
            raise ValueError("--early_stopping_patience counts evaluations: it needs --eval_every_steps above 0")


# ----------------------------------------------------------------------------------------- data
COLUMNS = "'prompt' and 'completion', 'messages' or 'text' (TRL's columns)"
# What Qwen3-style templates put before the last assistant turn whatever the data holds: learned only if it is there
EMPTY_REASONING = re.compile(r"<think>\s*</think>\s*")


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE where the loss does not count; the token itself where it does
    key: str  # what the validation split hashes: the record's own content (a record's examples share it)


def encode_completion(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Prompt tokens (with the tokenizer's BOS, if it adds one) masked, completion tokens and EOS learned."""
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + completion_ids, [IGNORE] * len(prompt_ids) + completion_ids


def encode_chat(tokenizer, messages: list[dict], learn_from: int = 0) -> list[tuple[list[int], list[int]]]:
    """Learn each assistant message (from index learn_from on) in the context the model sees when it writes it.

    That context is the conversation before it, rendered with the generation prompt; what the chat template
    renders after that context is the message (its end-of-turn included), learned, less an empty reasoning
    block the data does not hold. Turns share one example while each context continues the text so far (a
    template that only appends: one example per conversation); where the template rewrites an earlier turn
    (Qwen3 drops the reasoning of turns before the last user message), the next turn starts a new example.
    """
    examples, ids, labels, done = [], [], [], ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index < learn_from:
            continue
        context = render_chat(tokenizer, messages, index, add_generation_prompt=True)
        text = render_chat(tokenizer, messages, index + 1)
        if not text.startswith(context):
            raise UsageError(f"message {index + 1}: the chat template of --model renders this assistant message "
                             f"without the generation prompt it puts before it ({context[-30:]!r}), so the "
                             "message's tokens cannot be told from their context")
        turn = text[len(context):]
        empty = EMPTY_REASONING.match(turn)
        if empty and "<think>" not in message["content"] and not any(
                isinstance(message.get(k), str) and message[k].strip() for k in ("reasoning_content", "reasoning")):
            turn = turn[empty.end():]
        if not context.startswith(done):  # an earlier turn renders otherwise in this context: a new example
            examples.append((ids, labels))
            ids, labels, done = [], [], ""
        for piece, learn in ((context[len(done):], False), (turn, True)):
            tokens = tokenizer(piece, add_special_tokens=False)["input_ids"]
            ids, labels = ids + tokens, labels + (tokens if learn else [IGNORE] * len(tokens))
        done = context + turn
    return examples + [(ids, labels)]


def text_windows(tokenizer, text: str, max_length: int) -> list[list[int]]:
    """Plain text as windows of max_length tokens (BOS if the tokenizer adds one, EOS at the end)."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
    return [ids[i:i + max_length] for i in range(0, len(ids) - 1, max_length)]


def encode_record(record, tokenizer, max_length: int) -> tuple[list[tuple[list[int], list[int]]], str]:
    """One record in TRL's columns as (input_ids, labels) examples, and its kind; a wrong one raises UsageError."""
    if not isinstance(record, dict):
        raise UsageError(f"needs {COLUMNS}, got a JSON {type(record).__name__}")
    row = {name: value for name, value in record.items() if value is not None}  # datasets fills absent cells: None
    if "messages" in row or isinstance(row.get("prompt"), list):  # a chat, or TRL's conversational prompt/completion
        column = "messages" if "messages" in row else "prompt"
        messages = row["messages"] if column == "messages" else row["prompt"] + row.get("completion", [])
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise UsageError(f"'{column}' needs a list of messages, each with a 'role' and a 'content' string")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        learn_from = 0 if column == "messages" else len(row["prompt"])  # conversational: the completion only
        if not any(m["role"] == "assistant" and m["content"].strip() for m in messages[learn_from:]):
            raise UsageError("no assistant message with content: nothing to learn")
        if tokenizer.chat_template is None:
            raise UsageError("chat messages, but the tokenizer of --model has no chat template; use "
                             "prompt/completion pairs or a model with a chat template")
        return encode_chat(tokenizer, messages, learn_from), "chat"
    if "prompt" in row or "completion" in row:
        for name in ("prompt", "completion"):
            if name not in row:
                raise UsageError(f"no '{name}' column beside '{'completion' if name == 'prompt' else 'prompt'}'"
                                 f"{_did_you_mean(name, row, '')}")
            if not isinstance(row[name], str):
                raise UsageError(f"'{name}' must be a string, got {type(row[name]).__name__}")
        if not row["completion"].strip():
            raise UsageError("empty completion: nothing to learn")
        return [encode_completion(tokenizer, row["prompt"], row["completion"])], "completion"
    if "text" in row:
        if not isinstance(row["text"], str):
            raise UsageError(f"'text' must be a string, got {type(row['text']).__name__}")
        return [(ids, ids) for ids in text_windows(tokenizer, row["text"], max_length)], "text"
    guess = next((hint for name in ("prompt", "completion", "messages", "text")
                  if (hint := _did_you_mean(name, row, ""))), "")
    raise UsageError(f"needs {COLUMNS}; it has {', '.join(map(repr, record)) or 'no column'}{guess}")


def encode_rows(split: tuple[str, Rows], tokenizer, max_length: int) -> tuple[list[Example], str]:
    """One split, (its name in errors, its (where, record, key) rows), as examples and their kind. An example longer
    than max_length is refused, not cut."""
    (source, rows), examples, too_long, kinds = split, [], [], []
    for where, record, key in rows:
        try:
            pairs, kind = encode_record(record, tokenizer, max_length)
        except UsageError as error:
            raise UsageError(f"{source} {where}: {error}") from None
        kinds.append(kind)
        too_long += [f"{where} ({len(ids)} tokens)" for ids, _ in pairs if len(ids) > max_length]
        examples += [Example(ids, labels, key) for ids, labels in pairs]
    if too_long:  # refused, not truncated or dropped: either would silently train on something else
        raise UsageError(f"{source}: {len(too_long)} examples are longer than --max_length {max_length} "
                         f"(e.g. {', '.join(too_long[:3])}); raise --max_length or shorten them")
    return examples, kinds[0] if kinds else "completion"


def load_examples(cfg: Config, tokenizer) -> tuple[list[Example], list[Example], str]:
    """Training and validation examples, and the data's kind. Validation is the data's validation split
    (--data_val_split) if it has one, else the records whose stable hash falls below --val_fraction."""
    source = DataSource(cfg.data_path, cfg.data_config)  # refuses a path that is not there, a stray --data_config
    try:
        if (files := source.text_files()) is not None:  # plain text: windows of max_length tokens, every one learned
            kind, val_examples = "text", None
            examples = [Example(ids, ids, f"{f.name}:{i * cfg.max_length}") for f in files for i, ids in
                        enumerate(text_windows(tokenizer, f.read_text(encoding="utf-8"), cfg.max_length))]
        else:
            train, val = source.splits(cfg.data_split, cfg.data_val_split)  # val: None where the data has none
            examples, kind = encode_rows(train, tokenizer, cfg.max_length)
            val_examples = encode_rows(val, tokenizer, cfg.max_length)[0] if val is not None else None
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--data_path {source.path}: cannot read it ({error})") from None
    if val_examples is None:
        train_idx, val_idx = split_by_key([e.key for e in examples], cfg.val_fraction)
        examples, val_examples = [examples[i] for i in train_idx], [examples[i] for i in val_idx]
    if not examples or not val_examples:
        raise UsageError(f"--data_path {source.path}: {len(examples)} examples for training and {len(val_examples)} "
                         "for validation; both need some (more data, or another --val_fraction)")
    return examples, val_examples, kind


def batched(cfg: Config, tokenizer, train: list[Example], val: list[Example], accelerator):
    """The training and validation sets, their collate function and what a training item is: each batch padded to
    its longest example, or with --packing whole examples in rows of up to --max_length tokens (validation: one
    example a row)."""
    train_set, val_set = ([(e.input_ids, e.labels) for e in examples] for examples in (train, val))
    if not cfg.packing:
        return train_set, val_set, PadToLongest(tokenizer.pad_token_id), "training examples"
    train_set, val_set = PackedExamples(train_set, cfg.max_length), PackedExamples(val_set)
    accelerator.print(f"packed {len(train)} training examples into {len(train_set)} rows of up to "
                      f"{cfg.max_length} tokens ({train_set.filled(cfg.max_length):.0%} filled)")
    return train_set, val_set, PackedCollate(tokenizer.pad_token_id), "packed rows"


def target_losses(model, batch: dict[str, torch.Tensor], per_token: bool = False):
    """The loss of predicting each target token labels[t + 1] from position t (IGNORE labels skipped), in fp32:
    summed, or per token with the batch row of each. A padded batch runs with its attention mask, a packed one with
    position ids restarting at each example (no mask: transformers then keeps the examples apart); no KV cache:
    training needs none, and building one would switch that separation off. The logits are made for the target
    positions only, a chunk at a time (`target_token_losses`): never the whole [batch, seq, vocab] tensor."""
    return target_token_losses(model, batch["labels"], IGNORE, per_token=per_token, input_ids=batch["input_ids"],
                               attention_mask=batch.get("attention_mask"), position_ids=batch.get("position_ids"),
                               use_cache=False)


# ---------------------------------------------------------------------------------------- model
def load_model(cfg: Config, accelerator, config):
    """The pretrained model (a .gguf file: dequantized), adapted for training (LoRA, gradient checkpointing, compile).
    Under FSDP only rank 0 reads the weights and the other ranks receive their shards
    (`common.pretrained.load_once_per_machine`)."""
    from transformers import AutoModelForCausalLM

    # bf16 weights where the mixed precision is bf16 (a frozen LoRA base stays there; trained weights are fp32)
    dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
    return load_once_per_machine(accelerator, lambda: load_pretrained(cfg.model, config, dtype),
                                 lambda: AutoModelForCausalLM.from_config(config, dtype=dtype),
                                 lambda model: adapt_for_training(model, cfg))


def adapt_for_training(model, cfg: Config):
    model.config.use_cache = False  # training takes whole sequences; `generate` asks for the cache itself
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if cfg.lora_r:
        from peft import LoraConfig, get_peft_model

        check_lora_targets(model, cfg.lora_target_modules)
        targets = "all-linear" if "all-linear" in cfg.lora_target_modules else cfg.lora_target_modules
        with warnings.catch_warnings():  # peft asks the model's deprecated `is_gradient_checkpointing` on every run
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=targets,
                                                     lora_dropout=cfg.lora_dropout, task_type="CAUSAL_LM"))
    else:
        model = model.float()  # fp32 master weights; accelerate's autocast computes in bf16 where it is on
    if cfg.compile:  # each decoder layer in place: one graph reused by every layer, state-dict keys unchanged
        for module in model.modules():
            if type(module).__name__ in (getattr(model, "_no_split_modules", None) or []):
                module.compile()
    return model


# ----------------------------------------------------------------------------- evaluation, export
@torch.no_grad()
def evaluate(model, loader, accelerator) -> dict[str, float]:
    model.eval()
    total, tokens = 0.0, 0
    for batch in loader:
        losses, rows = target_losses(model, batch, per_token=True)
        # Per-example sums and counts: gather_for_metrics drops the examples DDP padding repeated.
        per_example = torch.zeros(len(batch["labels"]), dtype=torch.float64, device=losses.device)
        sums, counts = accelerator.gather_for_metrics(
            (per_example.index_add_(0, rows, losses.double()), (batch["labels"][:, 1:] != IGNORE).sum(1)))
        total += sums.sum().item()
        tokens += int(counts.sum().item())
    model.train()
    loss = total / max(tokens, 1)
    return {"val/loss": loss, "val/perplexity": math.exp(min(loss, 50.0)), "val/tokens": tokens}


def probe_prompts(examples: list[Example], count: int, eos_id: int) -> list[tuple[list[int], list[int]]]:
    """The first `count` examples as (prompt, answer): the tokens before the first learned one, and the learned ones
    after them up to the end of the sequence (a completion; a first assistant turn), cut before the EOS."""
    probes = []
    for example in examples[:count]:
        first = next((i for i, label in enumerate(example.labels) if label != IGNORE), 0)
        end = next((i for i in range(first, len(example.labels)) if example.labels[i] == IGNORE), len(example.labels))
        answer = example.input_ids[first:end]
        probes.append((example.input_ids[:first], answer[:answer.index(eos_id)] if eos_id in answer else answer))
    return probes


def sample(cfg: Config, model, tokenizer, kind: str, example: Example, device) -> str:
    """The sample at the end: its prompt, --prompt (chat data: as the user message) or else a validation example up to
    its first learned token, and the --sample_tokens (greedy) the model writes after it."""
    if not cfg.prompt:
        prompt_ids = example.input_ids[:next((i for i, label in enumerate(example.labels) if label != IGNORE), 1)]
    else:
        text = tokenizer.apply_chat_template([{"role": "user", "content": cfg.prompt}], tokenize=False,
                                             add_generation_prompt=True) if kind == "chat" else cfg.prompt
        prompt_ids = tokenizer(text, add_special_tokens=kind != "chat")["input_ids"]
    written = generate(model, [prompt_ids], [cfg.sample_tokens], tokenizer.eos_token_id, tokenizer.pad_token_id,
                       device)[0]
    return tokenizer.decode(prompt_ids) + tokenizer.decode(written)


def export_model(accelerator, model, tokenizer, cfg: Config, state, step: int, checkpoints: list[Path]) -> Path:
    """save_pretrained (safetensors) + tokenizer in <output_dir>/model, loadable without accelerate; under FSDP gathered
    on the main process. LoRA: the adapter (PeftModel.from_pretrained), or with --merge_lora the merged model. Written
    atomically; `step`: the step whose weights the model holds, said with how to load them. Full fine-tuning on one
    process or DDP: the weights file of that step's checkpoint is linked, not written again."""
    adapter = cfg.lora_r and not cfg.merge_lora
    saved = next((path / "model.safetensors" for path in checkpoints if path.name.endswith(f"_{step:08d}")), None)
    export = export_pretrained(accelerator, model, tokenizer, Path(cfg.output_dir) / "model", cfg.model,
                               merge_adapter=bool(cfg.lora_r and cfg.merge_lora), weights=saved)
    which = f"step {step}" + (f" (best val/loss {state.best_metric:.4f})" if step == state.best_step else "")
    accelerator.print(f"exported the weights of {which} to {export}: load it with "
                      + (f"PeftModel.from_pretrained({from_pretrained_call(cfg.model)}, {str(export)!r})" if adapter
                         else "AutoModelForCausalLM.from_pretrained"))
    return export


def early_stop(cfg: Config, state) -> str | None:
    """Why the run ends early (--early_stopping_patience evaluations without a better val/loss), or None. From the
    state alone, so a resumed run goes on counting where it stopped."""
    if cfg.early_stopping_patience and state.best_step is not None and \
            (state.step - state.best_step) // cfg.eval_every_steps >= cfg.early_stopping_patience:
        return (f"early stopping: no better val/loss in {cfg.early_stopping_patience} evaluations after step "
                f"{state.best_step}")
    return None


# ----------------------------------------------------------------------------------------- main
@with_exit_codes(interrupted="the checkpoints saved before are intact: continue with --resume auto",
                 release=release_process_group)  # the process group freed before Python shuts down
def main(argv: list[str] | None = None) -> dict[str, float]:
    cfg = parse_config(Config, argv)
    accelerator, preemption = start_run(cfg)  # output folder checked, Accelerator, stop signals, seed
    torch.set_float32_matmul_precision("high")

    # Everything the user passed is checked before anything is written: model, tokenizer, data, LoRA targets.
    tokenizer, model_config = load_tokenizer_and_config(cfg.model)
    if cfg.packing and (why := unpackable(model_config)):
        raise UsageError(f"--packing: {cfg.model} cannot be trained on packed rows: {why}")
    train_examples, val_examples, kind = load_examples(cfg, tokenizer)
    train_set, val_set, collate, what = batched(cfg, tokenizer, train_examples, val_examples, accelerator)
    train_loader, val_loader, batches_per_epoch = build_loaders(  # prepared: each rank holds its shard
        accelerator, train_set, val_set, batch_size=cfg.batch_size, seed=cfg.seed, num_workers=cfg.num_workers,
        what=what, collate_fn=collate)
    model = load_model(cfg, accelerator, model_config)
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_params = sum(p.numel() for p in model.parameters())
    learning_rate = scale_learning_rate(cfg.learning_rate, accelerator.num_processes, cfg.lr_scaling)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, cfg.weight_decay), lr=learning_rate, betas=(0.9, 0.95),
                                  fused=fused_adamw_on(accelerator))
    scheduler = warmup_cosine(optimizer, min(cfg.warmup_steps, cfg.max_steps // 2), cfg.max_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if cfg.lora_r:
        keep_only_trained_in_checkpoints(accelerator, model)  # the adapter, not the frozen base

    ckpt = CheckpointManager.for_run(  # saves in the background (--checkpoint_background)
        accelerator, cfg, template="finetune_causal_lm", metric="val/loss", mode="min",
        model_info={"model": cfg.model, "data": kind, "lora_r": cfg.lora_r},
        length="max_steps", total_steps=cfg.max_steps,  # a resume may train longer: the schedule then follows
        settings={"records split by": RECORD_KEYS} if kind != "text" else None)  # an older run's records split apart
    state = ckpt.resume(cfg.resume)  # also gives each rank its own dropout stream
    status = RunStatus(accelerator, cfg.output_dir, state, ckpt)  # status.json: running (step: last checkpoint), end
    tracker = Tracker.for_run(accelerator, cfg, resume_step=state.step)  # W&B, metrics.jsonl: main process
    accelerator.print(f"{cfg.model}: {n_params:,} parameters, {n_trained:,} trained "
                      f"({f'LoRA r={cfg.lora_r}' if cfg.lora_r else 'full fine-tuning'}); {len(train_examples)} "
                      f"training / {len(val_examples)} validation examples ({kind} data from {cfg.data_path}), "
                      f"{cfg.max_steps} optimizer steps ({batches_per_epoch} micro-batches per epoch), "
                      f"learning rate {learning_rate:g}")

    # A few validation prompts answered at each evaluation (text data has no prompts to answer)
    probes = probe_prompts(val_examples, cfg.eval_samples, tokenizer.eos_token_id) if kind != "text" else []

    def validate(record: bool = True) -> dict[str, float]:
        metrics = evaluate(model, val_loader, accelerator)
        samples, exact = answer_probes(model, probes, tokenizer, accelerator.device) if record else ([], 0.0)
        if samples and kind == "completion":
            metrics["val/exact_match"] = exact
        say(accelerator, f"step {state.step}: val loss {metrics['val/loss']:.4f}, "
                         f"perplexity {metrics['val/perplexity']:.2f} (completion tokens only)"
                         + (f", exact match {exact:.0%} of {len(samples)}" if "val/exact_match" in metrics else ""))
        if record:  # not when a finished run is resumed: its evaluation is logged and saved already
            tracker.log(metrics, step=state.step)
            tracker.log_samples(samples, step=state.step)  # samples.jsonl, and a W&B table
            ckpt.save(state, metrics["val/loss"])  # and the best checkpoint, if it is the best so far
        return metrics

    if state.step == 0:  # the pretrained model's score, what fine-tuning improves (logged once over restarts)
        at_start = evaluate(model, val_loader, accelerator)
        say(accelerator, f"before fine-tuning: val loss {at_start['val/loss']:.4f}")
        tracker.log_once(at_start, step=0)
    # Speed (non-padding tokens, counted on the device), data wait and step time, in each log line
    throughput = Throughput(accelerator, "tokens", lambda batch: batch["tokens"], cfg.num_workers)
    bar = progress_bar(accelerator, cfg.max_steps, initial=state.step)
    metrics: dict[str, float] = {}
    stopping = False
    early_stopped = early_stop(cfg, state)  # a resumed run that had stopped early trains no further
    step_sums = torch.zeros(2, device=accelerator.device)  # this rank's loss sum and target count in this step
    model.train()
    throughput.restart()
    while state.step < cfg.max_steps and not (stopping or early_stopped):
        train_loader.set_epoch(state.epoch)  # a different order every epoch, the same on every rank
        skip = state.batches_in_epoch  # non-zero only in the epoch a resume lands in
        batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        for batch in throughput.timed(batches):
            optimizer.zero_grad(set_to_none=True)  # accelerate makes this a no-op inside an accumulation window
            with accelerator.accumulate(model):
                # Summed over this micro-batch's completion tokens (the logits of those alone, a chunk at a time);
                # the step's gradient becomes the mean over all its target tokens once the last backward is done.
                loss = target_losses(model, batch)
                labels = batch["labels"]
                accelerator.backward(loss)
                step_sums += torch.stack([loss.detach(), (labels[:, 1:] != IGNORE).sum().float()])  # no graph kept
                if accelerator.sync_gradients:
                    # Every target token of the step weighs the same, on whichever micro-batch and rank it is
                    trained = [p for p in model.parameters() if p.requires_grad]  # FSDP2 swaps them: asked here
                    step_sums = average_over_targets(trained, step_sums, accelerator)
                    grad_norm = accelerator.clip_grad_norm_(trained, cfg.grad_clip or math.inf)  # unscales fp16
                    # One host sync per step: finite gradients? any rank's stop signal or failed checkpoint write?
                    if not preemption.check_step(grad_norm, ckpt) and accelerator.scaler is None:
                        raise NonFiniteError(f"non-finite gradients at step {state.step + 1} (loss "
                                             f"{(step_sums[0] / step_sums[1]).item()}); {ckpt.kept()}")
                optimizer.step()  # skipped by accelerate until the accumulation window is complete
                state.skipped_steps += accelerator.sync_gradients and accelerator.optimizer_step_was_skipped
            state.count_micro_batch(batches_per_epoch)  # data position and epoch: what resumes
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            # the step's loss and target count, every rank's (the same on all ranks), join the log interval
            state.count_step(loss_sum=step_sums[0], targets=step_sums[1])
            step_sums = torch.zeros(2, device=accelerator.device)
            bar.update(1)
            if state.step % cfg.log_every_steps == 0:
                logged = {"train/loss": state.take_interval_loss(), **throughput.read(),  # the next interval starts
                          "lr": scheduler.get_last_lr()[0], "train/skipped_steps": state.skipped_steps}
                tracker.log(logged, step=state.step)
                bar.set_postfix(loss=f"{logged['train/loss']:.4f}", tok_s=f"{logged['tokens_per_s']:,.0f}",
                                data_wait=f"{logged['time/data_wait']:.0%}")
            if state.step == cfg.max_steps or (cfg.eval_every_steps and state.step % cfg.eval_every_steps == 0):
                metrics = validate()
                early_stopped = early_stop(cfg, state)  # the same on every rank: val/loss is gathered
                throughput.restart()  # throughput counts training only
            ckpt.save_if_due(state)  # every --checkpoint_every_steps (a no-op if this step was just saved)
            finished = state.step == cfg.max_steps or early_stopped
            # a stop signal (agreed on every rank in check_step) or --stop_after_steps: the same step on every rank
            stopping = preemption.stop_now()
            if stopping or finished:
                stopping = not finished  # at the run's end it has finished, whatever else stops it
                break
    bar.close()

    if early_stopped:
        accelerator.print(f"stopped at step {state.step}: {early_stopped}")
    if stopping:
        ckpt.save(state, wait=True)  # exactly where we are, on disk before the process exits
    if state.step == cfg.max_steps or early_stopped:
        if not metrics:  # resumed a finished run: report it again, log nothing twice
            metrics = validate(record=False)
        ckpt.wait()  # the last checkpoint is on disk (a failed write ends the run here) before the export
        # the weights of the best val/loss (and what they came with), or the last step's
        exported_step = ckpt.restore_best(state) if cfg.export_from == "best" else state.step
        export_model(accelerator, model, tokenizer, cfg, state, exported_step, ckpt.complete_checkpoints())
        tracker.summary(metrics | {"best/val_loss": state.best_metric})
        if cfg.sample_tokens:
            accelerator.print(f"sample:\n{sample(cfg, model, tokenizer, kind, val_examples[0], accelerator.device)}")
    # status.json, W&B, why it stopped (early stopping, its stop signal, --stop_after_steps); exit code 75: requeue
    end_run(accelerator, status=status, tracker=tracker, preemption=preemption, stopping=stopping,
            reason=early_stopped)  # None: end_run's own (the stop signal or --stop_after_steps)
    return metrics


if __name__ == "__main__":
    main()
