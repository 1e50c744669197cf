"""A GPT-style causal language model, trained the same way on CPU, one GPU, DDP or FSDP2.

    accelerate launch -q --config_file accelerate_configs/cpu.yaml templates/language_model.py
    accelerate launch -q --config_file accelerate_configs/fsdp.yaml --num_processes 8 templates/language_model.py \
        --data_path data/openwebtext --n_layer 12 --n_head 12 --n_embd 768 --block_size 1024 --max_steps 600000

Byte-level by default (one token per byte, no tokenizer to download). Data: the Python standard
library's own sources by default; `--data_path` names a text file, a folder of text files, or
uint16 token files as nanoGPT's `prepare.py` writes them (`file.bin`, or a folder with `train.bin`
and `val.bin`), which are memory-mapped. Copy this file plus `common/` into your project.
"""

from __future__ import annotations

import logging
import math
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Subset

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
from common.config import RunOptions, option, parse_config
from common.data import TokenWindows, build_loaders, split_by_key, token_file_splits
from common.errors import NonFiniteError, RunStatus, UsageError, with_exit_codes
from common.export import export_weights, exported_model, load_exported
from common.optim import OptimOptions, fused_adamw_on, scale_learning_rate, warmup_cosine, weight_decay_groups
from common.tracking import Tracker, progress_bar, say

common.hand_back(THEIRS, imported=__name__ != "__main__")

# accelerate warns at every checkpoint that it stored the tied lm_head.weight once; loading re-ties it.
logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)

@dataclass
class Config(OptimOptions, RunOptions):
    """Train a GPT-style language model: byte-level on the Python stdlib by default, or your text or token files."""

    data_path: str | None = option(None, "Text file, folder of text files, or uint16 token file(s); default: stdlib.")
    val_fraction: float = option(0.1, "Held out: whole files of a folder, or a single file's tail.", "(0, 1)")
    vocab_size: int = option(0, "Token files: 0 finds the largest id (+1, rounded up to 64s). Text: 256.", "[0, 65536]")
    max_steps: int = option(1000, "Optimizer steps to train for.", "[1, 99999999]")  # checkpoint names: 8 digits
    eval_every_steps: int = option(200, "Validate (and checkpoint) every N optimizer steps; 0: only at the end.",
                                   "[0, inf)", may_change=True)
    eval_batches: int = option(8, "Validation batches (over all processes together), the same each time.", "[1, inf)")
    batch_size: int = option(32, "Sequences per process, per micro-batch.", "[1, inf)")
    learning_rate: float = option(5e-3, "Peak LR for one process (~6e-4 for GPT-2 sizes).", "(0, inf)")
    block_size: int = option(64, "Context length in tokens.", "[1, inf)")
    n_layer: int = option(3, "Transformer blocks.", "[1, inf)")
    n_head: int = option(4, "Attention heads per block.", "[1, inf)")
    n_embd: int = option(64, "Model width (a multiple of n_head).", "[1, inf)")
    dropout: float = option(0.0, "Dropout on embeddings, attention and residual branches.", "[0, 1)")
    init_from: str | None = option(None, "A finished run (folder or model.safetensors) to start from (same model).")
    compile: bool = option(False, "torch.compile each transformer block.", may_change=True)
    activation_checkpointing: bool = option(False, "Recompute each block's activations in backward: less memory.",
                                            may_change=True)
    prompt: str = option("def ", "Text the sample at the end continues (byte-level data only).", may_change=True)
    sample_tokens: int = option(200, "Tokens to sample at the end (0: no sample).", "[0, inf)", may_change=True)
    temperature: float = option(0.8, "Sampling temperature of that sample.", "[0.001, inf)", may_change=True)
    # -1 picks 0 here: a slice of in-memory text or of a memory-mapped token file is cheaper than a hop through a
    # worker (bench/data_loading.py); raise it for slow storage.
    num_workers: int = option(0, "Loader workers per process; -1 picks for the data (0).", "[-1, 128]", may_change=True)
    peak_tflops: float = option(0.0, "Peak TFLOP/s of one device for MFU (0: look the GPU up by name).", "[0, inf)",
                                may_change=True)
    output_dir: str = option("runs/language_model", "Checkpoints, metrics, status.json and the export go here.")
    log_every_steps: int = option(50, "Log loss, throughput and memory every N optimizer steps.", "[1, inf)")
    wandb_project: str = option("language-model-template",
                                "The run's W&B project, MLflow experiment and trackio project.")

    def __post_init__(self):
        super().__post_init__()
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")


# ----------------------------------------------------------------------------------------- data
@dataclass
class Corpus:
    train: TokenWindows
    val: TokenWindows
    vocab_size: int
    byte_level: bool  # one token per byte: bits per byte and text samples make sense
    description: str


def stdlib_sources() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages", "__pycache__"}
    return root, sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1]))


def read_text_files(files: list[Path]) -> np.ndarray:
    try:
        return np.frombuffer(b"".join(path.read_bytes() for path in files), dtype=np.uint8)
    except OSError as error:
        raise UsageError(f"cannot read {error.filename} ({error.strerror})") from None


def load_corpus(cfg: Config) -> Corpus:
    """Train and validation token streams; no file (or byte of a single file) is in both."""
    if cfg.data_path is None:
        root, files = stdlib_sources()
        if not files:
            raise UsageError(f"no Python sources found under {root}; pass --data_path")
        return text_corpus(root, files, cfg, f"{len(files)} files of the Python standard library in {root}")
    path = Path(cfg.data_path)
    if not path.exists():
        raise UsageError(f"--data_path {path}: no such file or folder")
    if path.suffix == ".bin" or (path.is_dir() and (path / "train.bin").exists()):
        train, val, vocab_size = token_file_splits(path, cfg.block_size, cfg.val_fraction, cfg.vocab_size)
        return check_corpus(Corpus(train, val, vocab_size, False, f"uint16 tokens from {path}"), cfg)
    if path.is_dir():
        hidden = lambda p: any(part.startswith(".") for part in p.relative_to(path).parts)  # noqa: E731
        files = sorted(p for p in path.rglob("*") if p.is_file() and not hidden(p))
        return text_corpus(path, files, cfg, f"{len(files)} files under {path}")
    return text_corpus(path.parent, [path], cfg, f"text file {path}")


def text_corpus(root: Path, files: list[Path], cfg: Config, description: str) -> Corpus:
    if cfg.vocab_size not in (0, 256):
        raise UsageError(f"--vocab_size {cfg.vocab_size}: text is read as bytes, a vocabulary of 256")
    train_idx, val_idx = split_by_key([str(p.relative_to(root)) for p in files], cfg.val_fraction)
    if train_idx and val_idx:  # whole files in each split, by a stable hash of their path
        train = TokenWindows(read_text_files([files[i] for i in train_idx]), cfg.block_size)
        val = TokenWindows(read_text_files([files[i] for i in val_idx]), cfg.block_size)
    else:  # one file, or too few for both splits: hold out the tail
        data = read_text_files(files)
        if len(data) == 0:
            raise UsageError(f"{description}: empty corpus, no bytes to train on")
        cut = len(data) - int(len(data) * cfg.val_fraction)
        train, val = TokenWindows(data, cfg.block_size, 0, cut), TokenWindows(data, cfg.block_size, cut, len(data))
    return check_corpus(Corpus(train, val, 256, True, description), cfg)


def check_corpus(corpus: Corpus, cfg: Config) -> Corpus:
    if len(corpus.train) == 0 or len(corpus.val) == 0:
        train, val = corpus.train.stop - corpus.train.start, corpus.val.stop - corpus.val.start
        raise UsageError(f"{corpus.description}: {train} training / {val} validation tokens, too few for a window "
                         f"of --block_size {cfg.block_size} + 1 in each split")
    return corpus


def evenly_spread(windows: TokenWindows, count: int) -> Subset:
    """Validation: `count` windows spread evenly over the split, the same every time and for any number of processes."""
    spread = np.unique(np.linspace(0, len(windows) - 1, min(len(windows), count)).round().astype(int))
    return Subset(windows, spread.tolist())


def unigram_entropy(tokens: np.ndarray) -> float:
    """Bits per token of the best model that ignores context: -sum p log2 p over token frequencies."""
    p = np.bincount(tokens)
    p = p[p > 0] / len(tokens)
    return float(-(p * np.log2(p)).sum())


# ---------------------------------------------------------------------------------------- model
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        # Flash or memory-efficient kernels where the device has them; the mask is implicit.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-norm transformer block; `Block` is also the class accelerate_configs/fsdp.yaml wraps as one FSDP unit."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, activation_checkpointing: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, bias=False)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd, bias=False)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=False))
        self.drop = nn.Dropout(dropout)
        self.activation_checkpointing = activation_checkpointing

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            # Inside the block, so FSDP's gather/free hooks stay outside the recomputed region; the
            # RNG state is replayed, so recomputed dropout masks equal the original ones.
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float = 0.0,
                 activation_checkpointing: bool = False):
        super().__init__()
        # Stored with the run and in the export: GPT(**options) rebuilds this model anywhere.
        self.options = dict(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                            dropout=dropout)
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, activation_checkpointing) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=False)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: fewer parameters, and better for small models
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        for block in self.blocks:  # GPT-2: scale the projections into the residual stream by depth
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.block_size:
            raise ValueError(f"sequence of {idx.shape[1]} tokens; this model takes at most {self.block_size}")
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (PaLM appendix B): 6 per weight use plus the attention scores.

        The position table does no matmul; the token table does (it is also the output layer).
        Recomputation by activation checkpointing is not counted: this is model FLOPs, for MFU.
        """
        n = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        n_layer, n_embd = len(self.blocks), self.wte.weight.shape[1]
        return 6 * n + 12 * n_layer * n_embd * seq_len


def build_model(cfg: Config, vocab_size: int) -> GPT:
    """A new model, or with --init_from one holding an export's weights (its shapes must match the options);
    compiled block by block with --compile."""
    block_size = cfg.block_size
    init_from = exported_model(cfg.init_from) if cfg.init_from is not None else None
    if init_from is not None:
        positions = exported_positions(init_from)
        if positions is not None and cfg.block_size > positions:
            raise UsageError(f"--block_size {cfg.block_size} is longer than the {positions} positions "
                             f"the model in {cfg.init_from} allows")
        block_size = positions or cfg.block_size  # shorter training sequences use the first positions
    model = GPT(vocab_size, block_size, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout, cfg.activation_checkpointing)
    if init_from is not None:
        load_exported(model, init_from)  # refuses any other shape
    if cfg.compile:  # each block in place: one small graph reused by every block, state-dict keys unchanged
        for block in model.blocks:
            block.compile()
    return model


def exported_positions(path: Path) -> int | None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_slice("wpe.weight").get_shape()[0] if "wpe.weight" in handle.keys() else None
    except (OSError, SafetensorError) as error:
        raise UsageError(f"--init_from {path}: not a readable safetensors export ({error})") from None


# ----------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, loader, accelerator) -> dict[str, float]:
    model.eval()
    total, windows, block_size = 0.0, 0, 0
    for inputs, targets in loader:
        losses = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten(), reduction="none")
        # Per-window sums: gather_for_metrics drops the windows DDP padding repeated, so each counts once.
        losses = accelerator.gather_for_metrics(losses.view(targets.shape).sum(1))
        total += losses.double().sum().item()
        windows += losses.numel()
        block_size = targets.shape[1]
    model.train()
    return {"val/loss": total / (windows * block_size), "val/tokens": windows * block_size}


@torch.no_grad()
def generate(model, prompt: torch.Tensor, new_tokens: int, block_size: int, temperature: float,
             generator: torch.Generator) -> torch.Tensor:
    """Sample continuations; every rank runs it, as FSDP needs all ranks in each forward."""
    model.eval()
    idx = prompt
    for _ in range(new_tokens):
        logits = model(idx[:, -block_size:])[:, -1, :].float() / temperature
        idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)], dim=1)
    model.train()
    return idx[:, prompt.shape[1]:]


def sample(cfg: Config, model, device) -> str:
    """The sample at the end: --prompt and the --sample_tokens bytes the model writes after it, drawn with --seed."""
    prompt = torch.tensor([list(cfg.prompt.encode("utf-8")) or [10]], device=device)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    written = generate(model, prompt, cfg.sample_tokens, cfg.block_size, cfg.temperature, generator)
    return cfg.prompt + bytes(written[0].tolist()).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------- main
@with_exit_codes(interrupted="the checkpoints saved before are intact: continue with --resume auto",
                 release=release_process_group)  # the process group freed before Python shuts down
def main(argv: list[str] | None = None) -> dict[str, float]:
    cfg = parse_config(Config, argv)
    accelerator, preemption = start_run(cfg)  # output folder checked, Accelerator, stop signals, seed
    torch.set_float32_matmul_precision("high")  # TF32 for the fp32 matmuls left on Ampere and newer GPUs

    corpus = load_corpus(cfg)
    val_set = evenly_spread(corpus.val, cfg.eval_batches * cfg.batch_size)
    train_loader, val_loader, batches_per_epoch = build_loaders(  # prepared: each rank holds its shard
        accelerator, corpus.train, val_set, batch_size=cfg.batch_size, seed=cfg.seed,
        num_workers=max(0, cfg.num_workers), what="training windows")  # -1 (pick for the data) is 0: see --help

    model = build_model(cfg, corpus.vocab_size)
    model_info = {"model": model.options, "byte_level": corpus.byte_level}  # what using the model needs, with the run
    flops_per_token = model.flops_per_token(cfg.block_size)
    n_params = sum(p.numel() for p in model.parameters())
    learning_rate = scale_learning_rate(cfg.learning_rate, accelerator.num_processes, cfg.lr_scaling)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, cfg.weight_decay), lr=learning_rate, betas=(0.9, 0.95),
                                  fused=fused_adamw_on(accelerator))
    scheduler = warmup_cosine(optimizer, min(cfg.warmup_steps, cfg.max_steps // 2), cfg.max_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    ckpt = CheckpointManager.for_run(  # saves in the background (--checkpoint_background)
        accelerator, cfg, template="language_model", metric="val/loss", mode="min", model_info=model_info,
        length="max_steps", total_steps=cfg.max_steps)  # a resume may train longer: the schedule then follows
    state = ckpt.resume(cfg.resume)  # also gives each rank its own dropout stream
    status = RunStatus(accelerator, cfg.output_dir, state, ckpt)  # status.json: running (step: last checkpoint), end
    tracker = Tracker.for_run(accelerator, cfg, resume_step=state.step)  # W&B, metrics.jsonl: main process
    throughput = Throughput(accelerator, "tokens", cfg.batch_size * cfg.block_size, max(0, cfg.num_workers),
                            flops_per_token, cfg.peak_tflops)  # speed, data wait and MFU, in each log line
    accelerator.print(f"{corpus.description}\n{len(corpus.train) * cfg.block_size:,} training tokens, "
                      f"{len(val_set) * cfg.block_size:,} validation tokens, vocabulary {corpus.vocab_size}, "
                      f"{n_params:,} parameters, {cfg.max_steps} optimizer steps "
                      f"({batches_per_epoch} micro-batches per epoch), learning rate {learning_rate:g}")

    def validate(record: bool = True) -> dict[str, float]:
        metrics = evaluate(model, val_loader, accelerator)
        if corpus.byte_level:  # one token is one byte: nats per token / ln 2 = bits per byte
            metrics["val/bpb"] = metrics["val/loss"] / math.log(2)
        bpb = f", {metrics['val/bpb']:.3f} bits per byte" if "val/bpb" in metrics else ""
        say(accelerator, f"step {state.step}: val loss {metrics['val/loss']:.4f}{bpb}")
        if record:  # not when a finished run is resumed: its evaluation is logged and saved already
            tracker.log(metrics, step=state.step)
            ckpt.save(state, metrics["val/loss"])  # and the best checkpoint, if it is the best so far
        return metrics

    bar = progress_bar(accelerator, cfg.max_steps, initial=state.step)
    metrics: dict[str, float] = {}
    stopping = False
    model.train()
    throughput.restart()
    while state.step < cfg.max_steps and not stopping:
        train_loader.set_epoch(state.epoch)  # a different order every epoch, the same on every rank
        skip = state.batches_in_epoch  # non-zero only in the epoch a resume lands in
        batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        for inputs, targets in throughput.timed(batches):
            optimizer.zero_grad(set_to_none=True)  # accelerate makes this a no-op inside an accumulation window
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # unscales fp16 gradients before clipping
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
                    # One host sync per step: finite gradients? any rank's stop signal or failed checkpoint write?
                    if not preemption.check_step(grad_norm, ckpt) and accelerator.scaler is None:
                        raise NonFiniteError(f"non-finite gradients at step {state.step + 1} (loss {loss.item()}); "
                                             f"{ckpt.kept()}")
                optimizer.step()  # skipped by accelerate until the accumulation window is complete
                # an fp16 overflow: the scaler skipped this step (counted over the whole run)
                state.skipped_steps += accelerator.sync_gradients and accelerator.optimizer_step_was_skipped
            state.count_micro_batch(batches_per_epoch, loss)  # data position, epoch, interval loss: what resumes
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            state.count_step()
            bar.update(1)
            if state.step % cfg.log_every_steps == 0:
                logged = {"train/loss": state.take_interval_loss(), **throughput.read(),  # the next interval starts
                          "lr": scheduler.get_last_lr()[0], "train/skipped_steps": state.skipped_steps}
                tracker.log(logged, step=state.step)
                bar.set_postfix(loss=f"{logged['train/loss']:.4f}", tok_s=f"{logged['tokens_per_s']:,.0f}",
                                data_wait=f"{logged['time/data_wait']:.0%}")
            if state.step == cfg.max_steps or (cfg.eval_every_steps and state.step % cfg.eval_every_steps == 0):
                metrics = validate()
                throughput.restart()  # throughput counts training only
            ckpt.save_if_due(state)  # every --checkpoint_every_steps (a no-op if this step was just saved)
            finished = state.step == cfg.max_steps
            # a stop signal (agreed on every rank in check_step) or --stop_after_steps: the same step on every rank
            stopping = preemption.stop_now()
            if stopping or finished:
                stopping = not finished  # at the run's end it has finished, whatever else stops it
                break
    bar.close()

    if stopping:
        ckpt.save(state, wait=True)  # exactly where we are, on disk before the process exits
    if state.step == cfg.max_steps:
        if not metrics:  # resumed a finished run: report it again, log nothing twice
            metrics = validate(record=False)
        ckpt.wait()  # the last checkpoint is on disk (a failed write ends the run here) before the export
        export_weights(accelerator, model, Path(cfg.output_dir) / "model.safetensors", info=model_info)
        if corpus.byte_level:  # the context-free baseline: what a model ignoring context would score
            entropy = unigram_entropy(np.concatenate([targets.numpy() for _, targets in val_set]))
            metrics["val/unigram_entropy"] = entropy
            accelerator.print(f"validation: {metrics['val/bpb']:.3f} bits per byte; unigram entropy of the same bytes "
                              f"{entropy:.3f} bits per byte; ratio {metrics['val/bpb'] / entropy:.3f}")
        tracker.summary(metrics | {"best/val_loss": state.best_metric})
        if corpus.byte_level and cfg.sample_tokens:
            accelerator.print(f"sample:\n{sample(cfg, model, accelerator.device)}")
    # status.json, W&B, why it stopped (its stop signal, --stop_after_steps); exit code 75: requeue
    end_run(accelerator, status=status, tracker=tracker, preemption=preemption, stopping=stopping)
    return metrics


if __name__ == "__main__":
    main()
