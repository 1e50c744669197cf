"""Image classification with a small residual CNN, on CPU, one GPU, DDP or FSDP2.

    accelerate launch -q --config_file accelerate_configs/cpu.yaml templates/image_classification.py
    accelerate launch -q --config_file accelerate_configs/ddp.yaml templates/image_classification.py \
        --data_dir /data/my_images --image_size 64 --epochs 30

Data: scikit-learn's handwritten digits by default (they ship with the package, no download), or
`--data_dir` with one folder per class (the ImageFolder layout), optionally split into `train/`
and `val/` folders. Copy this file plus `common/` into your project and change what you need.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, TensorDataset

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
from common.data import build_loaders, default_num_workers, split_by_key, split_indices
from common.errors import NonFiniteError, RunStatus, UsageError, with_exit_codes
from common.export import export_weights, exported_model, load_exported
from common.optim import OptimOptions, fused_adamw_on, scale_learning_rate, warmup_cosine, weight_decay_groups
from common.tracking import Tracker, progress_bar, say

common.hand_back(THEIRS, imported=__name__ != "__main__")

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


@dataclass
class Config(OptimOptions, RunOptions):
    """Train a residual CNN to classify images: scikit-learn's digits by default, or your class folders."""

    data_dir: str | None = option(None, "Folder of class folders (or train/ and val/ of them); default: digits.")
    image_size: int = option(32, "Side length images from --data_dir are resized to.", "[1, 1024]")
    val_fraction: float = option(0.2, "Share held out for validation when there is no val/ folder.", "(0, 1)")
    epochs: int = option(30, "Passes over the training data.", "[1, inf)")
    batch_size: int = option(64, "Images per process, per micro-batch.", "[1, inf)")
    learning_rate: float = option(2e-3, "Peak learning rate for one process.", "(0, inf)")
    weight_decay: float = option(0.05, "AdamW weight decay (matrices and kernels only).", "[0, inf)")
    width: int = option(32, "Channels of the first stage (doubled per stage).", "[1, inf)")
    depth: int = option(2, "Residual blocks per stage.", "[1, inf)")
    dropout: float = option(0.1, "Dropout before the classifier.", "[0, 1)")
    label_smoothing: float = option(0.05, "Cross-entropy label smoothing.", "[0, 1)")
    init_from: str | None = option(None, "A finished run (folder or model.safetensors) to start from (same model).")
    augment: bool = option(True, "Random shifts, scales and rotations of training images.")
    hflip: bool = option(False, "Also flip training images left-right (not for digits).")
    num_workers: int = option(-1, "Loader workers per process; -1 picks for the data.", "[-1, 128]", may_change=True)
    output_dir: str = option("runs/image_classification", "Checkpoints, metrics, status.json and the export go here.")
    wandb_project: str = option("image-classification-template",
                                "The run's W&B project, MLflow experiment and trackio project.")


# ----------------------------------------------------------------------------------------- data
class ImageFiles(Dataset):
    """Decodes and resizes images in the loader workers; random augmentation happens later, on the device."""

    def __init__(self, paths: list[Path], labels: list[int], image_size: int):
        self.paths, self.labels, self.image_size = paths, labels, image_size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(self.paths[index]) as image:
                image = image.convert("RGB").resize((self.image_size, self.image_size), Image.BILINEAR)
        except (OSError, UnidentifiedImageError) as error:
            raise UsageError(f"cannot read image {self.paths[index]}: {error}") from None
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (pixels - 0.5) / 0.25, self.labels[index]


def list_images(root: Path, classes: list[str] | None = None) -> tuple[list[Path], list[int], list[str]]:
    classes = classes or sorted(d.name for d in root.iterdir() if d.is_dir())
    paths, labels = [], []
    for label, name in enumerate(classes):
        for path in sorted((root / name).rglob("*")) if (root / name).is_dir() else []:
            if path.suffix.lower() in IMAGE_SUFFIXES:
                paths.append(path)
                labels.append(label)
    return paths, labels, classes


@dataclass
class Images:
    train: Dataset
    val: Dataset  # no sample is in both
    channels: int
    classes: list[str]  # class names in label order
    image_size: int  # side length of the images the model sees


def load_datasets(cfg: Config) -> Images:
    if cfg.data_dir is None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        full = TensorDataset((images - 0.5) / 0.25, torch.tensor(digits.target))
        train_idx, val_idx = split_indices(len(full), cfg.val_fraction, seed=1234)  # fixed: same split for every seed
        return Images(Subset(full, train_idx), Subset(full, val_idx), 1, [str(d) for d in range(10)], 8)
    root = Path(cfg.data_dir)
    if not root.is_dir():
        raise UsageError(f"--data_dir {root} is a file, not a folder of class folders" if root.exists() else
                         f"--data_dir {root}: no such folder")
    try:
        if (root / "train").is_dir() and (root / "val").is_dir():
            train_paths, train_labels, classes = list_images(root / "train")
            val_paths, val_labels, _ = list_images(root / "val", classes)
        else:
            paths, labels, classes = list_images(root)
            train_idx, val_idx = split_by_key([str(p.relative_to(root)) for p in paths], cfg.val_fraction)
            train_paths, train_labels = [paths[i] for i in train_idx], [labels[i] for i in train_idx]
            val_paths, val_labels = [paths[i] for i in val_idx], [labels[i] for i in val_idx]
    except OSError as error:  # a folder without read permission
        raise UsageError(f"--data_dir {root}: cannot read {error.filename} ({error.strerror})") from None
    if len(classes) < 2 or not train_paths or not val_paths:
        raise UsageError(
            f"--data_dir {root}: need at least 2 class folders with images ({', '.join(sorted(IMAGE_SUFFIXES))}) "
            f"in training and validation; found {len(classes)} classes, {len(train_paths)} + {len(val_paths)} images"
        )
    train, val = (ImageFiles(paths, labels, cfg.image_size) for paths, labels in
                  ((train_paths, train_labels), (val_paths, val_labels)))
    return Images(train, val, 3, classes, cfg.image_size)


def augment(images: torch.Tensor, hflip: bool) -> torch.Tensor:
    """Random affine jitter of a batch, on its device.

    Done here rather than in loader workers so its random numbers come from this process's RNG,
    which checkpoints save and restore: resumed runs augment exactly as uninterrupted ones.
    """
    n = images.shape[0]
    angle = (torch.rand(n, device=images.device) - 0.5) * (2 * math.pi / 18)  # +-10 degrees
    scale = 1.0 + (torch.rand(n, device=images.device) - 0.5) * 0.2
    shift = (torch.rand(n, 2, device=images.device) - 0.5) * 0.25
    flip = torch.where(torch.rand(n, device=images.device) < 0.5, -1.0, 1.0) if hflip else torch.ones_like(scale)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    rows = [torch.stack([cos * flip, -sin, shift[:, 0]], 1), torch.stack([sin * flip, cos, shift[:, 1]], 1)]
    theta = torch.stack(rows, 1)
    grid = F.affine_grid(theta.to(images.dtype), list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, padding_mode="border", align_corners=False)


# ---------------------------------------------------------------------------------------- model
def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm, not BatchNorm: no running statistics that would differ between ranks under FSDP
    (DDP copies rank 0's BatchNorm buffers every step, FSDP does not), and no dependence on the batch size."""
    return nn.GroupNorm(min(8, channels // 4) or 1, channels)


class Block(nn.Module):
    """A residual block; `Block` is also the class accelerate_configs/fsdp.yaml wraps as one FSDP unit."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = group_norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = group_norm(channels)
        nn.init.zeros_(self.norm2.weight)  # each block starts as the identity: stable early training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x))))))


class ResNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, width: int, depth: int, stages: int, dropout: float):
        super().__init__()
        # Stored with the run and in the export: ResNet(**options) rebuilds this model anywhere.
        self.options = dict(in_channels=in_channels, num_classes=num_classes, width=width, depth=depth, stages=stages,
                            dropout=dropout)
        layers: list[nn.Module] = [nn.Conv2d(in_channels, width, 3, padding=1, bias=False), group_norm(width),
                                   nn.ReLU()]
        channels = width
        for stage in range(stages):
            if stage > 0:  # halve the resolution, double the channels
                down = nn.Conv2d(channels, channels * 2, 3, stride=2, padding=1, bias=False)
                layers += [down, group_norm(channels * 2), nn.ReLU()]
                channels *= 2
            layers += [Block(channels) for _ in range(depth)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout),
                                  nn.Linear(channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build_model(cfg: Config, data: Images) -> ResNet:
    stages = max(2, min(4, int(math.log2(data.image_size)) - 1))  # down to about 4x4 before pooling
    return ResNet(data.channels, len(data.classes), cfg.width, cfg.depth, stages, cfg.dropout)


# ----------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, loader, accelerator) -> dict[str, float]:
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    for images, labels in loader:
        logits = model(images)
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        # gather_for_metrics drops the samples DDP padding repeated, so each is counted once.
        losses, predictions, labels = accelerator.gather_for_metrics((losses, logits.argmax(-1), labels))
        total_loss += losses.sum().item()
        correct += (predictions == labels).sum().item()
        count += labels.numel()
    model.train()
    return {"val/loss": total_loss / count, "val/accuracy": correct / count, "val/samples": count}


# ----------------------------------------------------------------------------------------- main
@with_exit_codes(interrupted="the checkpoints saved before are intact: continue with --resume auto",
                 release=release_process_group)  # the process group freed before Python shuts down
def main(argv: list[str] | None = None) -> dict[str, float]:
    cfg = parse_config(Config, argv)
    accelerator, preemption = start_run(cfg)  # output folder checked, Accelerator, stop signals, seed

    data = load_datasets(cfg)
    num_workers = cfg.num_workers if cfg.num_workers >= 0 else (0 if cfg.data_dir is None else default_num_workers())
    train_loader, val_loader, batches_per_epoch = build_loaders(  # prepared: each rank holds its shard
        accelerator, data.train, data.val, batch_size=cfg.batch_size, seed=cfg.seed, num_workers=num_workers,
        what="training images")
    total_steps = cfg.epochs * math.ceil(batches_per_epoch / cfg.gradient_accumulation_steps)

    model = build_model(cfg, data)
    if cfg.init_from is not None:  # a new run from a finished run's weights: its own optimizer and schedule
        load_exported(model, exported_model(cfg.init_from))  # refuses any other shape
    # What using the model needs, with the run and in the export: ResNet(**model), names of its outputs, input side.
    model_info = {"model": model.options, "classes": data.classes, "image_size": data.image_size}
    learning_rate = scale_learning_rate(cfg.learning_rate, accelerator.num_processes, cfg.lr_scaling)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, cfg.weight_decay), lr=learning_rate,
                                  fused=fused_adamw_on(accelerator))
    scheduler = warmup_cosine(optimizer, min(cfg.warmup_steps, total_steps // 2), total_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    ckpt = CheckpointManager.for_run(accelerator, cfg, template="image_classification", metric="val/accuracy",
                                     mode="max", model_info=model_info,  # in the background: --checkpoint_background
                                     # a resume may train more epochs: the schedule then follows the new length
                                     length="epochs", total_steps=total_steps)
    state = ckpt.resume(cfg.resume)  # also gives each rank its own dropout and augmentation stream
    status = RunStatus(accelerator, cfg.output_dir, state, ckpt)  # status.json: running (step: last checkpoint), end
    tracker = Tracker.for_run(accelerator, cfg, resume_step=state.step)  # W&B, metrics.jsonl: main process
    accelerator.print(f"{len(data.train)} training / {len(data.val)} validation images, {total_steps} optimizer steps, "
                      f"{sum(p.numel() for p in model.parameters()):,} parameters, learning rate {learning_rate:g}")

    throughput = Throughput(accelerator, "images", cfg.batch_size, num_workers)  # speed and data wait, logged
    bar = progress_bar(accelerator, total_steps, initial=state.step)
    metrics: dict[str, float] = {}
    stopping = False
    for epoch in range(state.epoch, cfg.epochs):
        model.train()
        train_loader.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
        skip = state.batches_in_epoch  # non-zero only in the epoch a resume lands in
        batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        for images, labels in throughput.timed(batches):
            optimizer.zero_grad(set_to_none=True)  # accelerate makes this a no-op inside an accumulation window
            with accelerator.accumulate(model):
                if cfg.augment:
                    images = augment(images, cfg.hflip)
                loss = F.cross_entropy(model(images), labels, label_smoothing=cfg.label_smoothing)
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
                logged = {"train/loss": state.take_interval_loss(),  # read here; the next interval starts
                          "lr": scheduler.get_last_lr()[0], **throughput.read(),
                          "train/skipped_steps": state.skipped_steps,
                          "epoch": state.epoch + state.batches_in_epoch / batches_per_epoch}
                tracker.log(logged, step=state.step)
                bar.set_postfix(loss=f"{logged['train/loss']:.4f}", data_wait=f"{logged['time/data_wait']:.0%}")
            if state.batches_in_epoch == 0:  # the epoch's last step: evaluate, then checkpoint with the result
                metrics = evaluate(model, val_loader, accelerator)
                tracker.log(metrics | {"epoch": state.epoch}, step=state.step)
                say(accelerator, f"epoch {state.epoch}/{cfg.epochs}: val loss {metrics['val/loss']:.4f}, "
                                 f"val accuracy {metrics['val/accuracy']:.2%}")
                ckpt.save(state, metrics["val/accuracy"])  # and the best checkpoint, if it is the best so far
                throughput.restart()  # throughput counts training only
            ckpt.save_if_due(state)  # every --checkpoint_every_steps (a no-op if this step was just saved)
            # a stop signal (agreed on every rank in check_step) or --stop_after_steps: the same step on every rank
            stopping = preemption.stop_now()
            if stopping:
                break
        if stopping:
            break
    bar.close()

    if stopping:
        ckpt.save(state, wait=True)  # exactly where we are, on disk before the process exits
    if state.epoch == cfg.epochs:
        if not metrics:  # resumed a finished run: report it again
            metrics = evaluate(model, val_loader, accelerator)
        ckpt.wait()  # the last checkpoint is on disk (a failed write ends the run here) before the export
        export_weights(accelerator, model, Path(cfg.output_dir) / "model.safetensors", info=model_info)
        tracker.summary(metrics | {"best/val_accuracy": state.best_metric})
        accelerator.print(f"final validation accuracy: {metrics['val/accuracy']:.2%} "
                          f"(best {state.best_metric:.2%} at step {state.best_step})")
    # status.json, W&B, why it stopped (its stop signal, --stop_after_steps); exit code 75: requeue
    end_run(accelerator, status=status, tracker=tracker, preemption=preemption, stopping=stopping)
    return metrics


if __name__ == "__main__":
    main()
