"""The final export: plain weights in one safetensors file that describes its model, or a Hugging Face model's
`save_pretrained` folder (`export_pretrained`), published atomically (`publish_export`); and the durability helpers
the checkpoints use too. Loading an export needs torch and safetensors only: this module imports nothing else at
import (writing one takes the run's Accelerator as an argument), so it can be copied into an inference service."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from common.errors import SaveError, UsageError, one_line

if TYPE_CHECKING:  # for the type hints only: loading an export needs no accelerate
    from accelerate import Accelerator


def export_weights(accelerator: Accelerator, model: torch.nn.Module, path: str | os.PathLike,
                   info: dict | None = None) -> Path:
    """Save the trained weights as one safetensors file that loads into the plain model; call on every rank (FSDP
    gathers the shards). Tied tensors are stored once and named in the metadata, and so is `info` (JSON): what
    rebuilding and using the model needs, read back with `export_info`."""
    state_dict = accelerator.get_state_dict(model)

    def write(tmp: Path) -> None:
        tensors, tied, seen = {}, {}, {}
        for key, tensor in state_dict.items():
            ptr = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            if ptr in seen:
                tied[key] = seen[ptr]
                continue
            seen[ptr] = key
            tensors[key] = tensor.detach().to("cpu").contiguous()
        metadata = {"format": "pt", "tied": json.dumps(tied)} | ({"info": json.dumps(info)} if info else {})
        save_file(tensors, str(tmp), metadata=metadata)

    return publish_export(accelerator, path, write)


def publish_export(accelerator: Accelerator, path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Write an export (a file or a folder) at `path` atomically; call on every rank. The main process runs
    `write(tmp)` (`tmp`: `.tmp-<name>` beside `path`), syncs `tmp` and renames it over the previous export, so `path`
    is always a whole export. A write that fails leaves no `.tmp-` behind and raises SaveError on every rank."""
    path = Path(path)
    failure = None
    if accelerator.is_main_process:
        tmp = path.with_name(f".tmp-{path.name}")
        try:
            _remove(tmp)  # left by an export a crash interrupted
            path.parent.mkdir(parents=True, exist_ok=True)
            write(tmp)
            fsync_tree(tmp)
            if tmp.is_dir() and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)  # a folder cannot be renamed over a folder that holds files
            os.replace(tmp, path)
            fsync_file(path.parent)
        except OSError as error:
            failure = one_line(error)
            with contextlib.suppress(OSError):
                _remove(tmp)  # free its space: nothing refers to it
    if (failure := from_main_process(failure)) is not None:  # every rank learns whether it worked
        raise SaveError(f"writing the export {path} failed: {failure}; the checkpoints are intact, "
                        "so --resume auto writes it again")
    return path


def export_pretrained(accelerator: Accelerator, model: torch.nn.Module, tokenizer, folder: str | os.PathLike,
                      base_model: str, merge_adapter: bool = False, weights: Path | None = None) -> Path:
    """A transformers model (or a peft one) as `save_pretrained` writes it, with its tokenizer and the base's
    generation config, published atomically; call on every rank. A LoRA model exports its adapter (on `base_model`,
    a local one by its absolute path), or with `merge_adapter` the merged model. `weights` (the step's checkpoint's
    model.safetensors) is hard-linked in where it holds exactly the tensors save_pretrained would write."""
    state_dict = accelerator.get_state_dict(model)  # full weights on the main process (FSDP gathers the shards)

    def write(tmp: Path) -> None:  # on the main process; publish_export renames it to `folder` when it is whole
        unwrapped = accelerator.unwrap_model(model)
        if merge_adapter:  # merged on a plain CPU copy: the trained model may be sharded
            from peft import get_peft_model
            from transformers import AutoModelForCausalLM

            base_config = unwrapped.get_base_model().config
            plain = get_peft_model(AutoModelForCausalLM.from_config(base_config, dtype=torch.float32),
                                   unwrapped.peft_config["default"])
            plain.load_state_dict({k: v.float() for k, v in state_dict.items()})
            plain.merge_and_unload().save_pretrained(tmp, safe_serialization=True)
        else:  # the weights linked from `weights` where that file holds them, else written
            linked = weights is not None and _holds_the_same(weights, state_dict, unwrapped)
            with warnings.catch_warnings():  # peft looks for the base's config.json to see whether its vocabulary
                # was resized (it never is here); a .gguf base or an offline Hub id has none beside it to read
                warnings.filterwarnings("ignore", "Could not find a config file", UserWarning)
                unwrapped.save_pretrained(tmp, state_dict={} if linked else state_dict, safe_serialization=True)
                if linked and not _link(weights, tmp / "model.safetensors"):  # a file system without hard links
                    unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        adapter_file = tmp / "adapter_config.json"
        if adapter_file.is_file() and Path(base_model).exists():  # a local base model by its absolute path, so
            saved = json.loads(adapter_file.read_text())  # the adapter loads from any folder (a Hub id stays)
            saved["base_model_name_or_path"] = str(Path(base_model).resolve())
            adapter_file.write_text(json.dumps(saved, indent=2) + "\n")
        config_file = tmp / "config.json"
        if config_file.is_file():  # FSDP2 renames the class (FSDPLlamaForCausalLM); record the real one
            saved = json.loads(config_file.read_text())
            saved["architectures"] = [a.removeprefix("FSDP") for a in saved.get("architectures") or []]
            saved["use_cache"] = True
            config_file.write_text(json.dumps(saved, indent=2) + "\n")
        generation = _generation_config(base_model, unwrapped)
        if generation is not None:  # the base's sampling defaults and stop ids: a merged or FSDP model was
            generation.use_cache = True  # rebuilt from its config; gradient checkpointing turned the cache off
            generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return publish_export(accelerator, folder, write)  # every rank learns whether it worked


_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _holds_the_same(path: Path, state_dict: dict, model: torch.nn.Module) -> bool:
    """Whether the safetensors file `path` has the tensors save_pretrained writes of `state_dict`: each name (tied
    copies left out) with its dtype and shape, and no other (a peft model, a sharded checkpoint: no)."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ())
    expected = {key: tensor for key, tensor in state_dict.items() if key not in tied}
    if hasattr(model, "peft_config") or not expected:
        return False
    try:
        with safe_open(str(path), framework="pt") as handle:
            return set(handle.keys()) == set(expected) and all(
                handle.get_slice(key).get_dtype() == _DTYPES.get(tensor.dtype)
                and handle.get_slice(key).get_shape() == list(tensor.shape) for key, tensor in expected.items())
    except (OSError, SafetensorError):
        return False


def _link(source: Path, target: Path) -> bool:
    """Hard-link `source` as `target`; False where the file system cannot (another device, no hard links)."""
    try:
        os.link(source, target)
    except OSError:
        return False
    return True


def _generation_config(name: str, model: torch.nn.Module):
    """The base model's generation_config.json (a Hub id from the local cache), or None if it has none. A .gguf file
    has none: the one transformers made from the file's config when it loaded the model (its special token ids)."""
    import copy

    from transformers import GenerationConfig  # only where a transformers model is exported

    if name.lower().endswith(".gguf"):
        return copy.deepcopy(getattr(model, "generation_config", None))
    try:
        return GenerationConfig.from_pretrained(name)
    except OSError:
        return None


def export_info(path: str | os.PathLike) -> dict:
    """What an export says about its model (e.g. the model's constructor arguments and class names), or {}."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return json.loads((handle.metadata() or {}).get("info", "{}"))
    except (OSError, SafetensorError, ValueError) as error:
        raise UsageError(f"{path}: not a readable safetensors export ({error})") from None


def exported_model(init_from: str | os.PathLike) -> Path:
    """The export `--init_from` names: a model.safetensors file, or a finished run's folder (its model.safetensors)."""
    path = Path(init_from)
    if path.is_dir():
        if not (path / "model.safetensors").is_file():
            raise UsageError(f"--init_from {init_from}: no model.safetensors in this folder (a run writes it when it "
                             "finishes); pass a finished run's folder or its model.safetensors")
        return path / "model.safetensors"
    if not path.is_file():
        raise UsageError(f"--init_from {init_from}: no such file or folder")
    return path


def load_exported(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load an export from `export_weights` into a plain (unwrapped) model, refusing any mismatch."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            tied = json.loads((handle.metadata() or {}).get("tied", "{}"))
        tensors = load_file(str(path))
    except (OSError, SafetensorError, ValueError) as error:
        raise UsageError(f"{path}: not a readable safetensors export ({error})") from None
    expected = model.state_dict()
    for key, source in tied.items():
        if source in tensors:
            tensors[key] = tensors[source]
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [k for k in expected if k in tensors and tensors[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        detail = (f"shape of {wrong[0]} is {tuple(tensors[wrong[0]].shape)}, the model has "
                  f"{tuple(expected[wrong[0]].shape)}" if wrong
                  else f"missing {missing[:3]}, unexpected {unexpected[:3]}")
        raise UsageError(f"{path} does not fit this model: {detail}")
    model.load_state_dict(tensors)


# ------------------------------------------------------------- durability, and what every rank learns of a write
def write_json(path: Path, data: dict) -> None:
    """Write a small JSON file whole or not at all: written beside it, synced, renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    fsync_file(tmp)
    os.replace(tmp, path)


def any_failure(failure: str | None, group=None) -> str | None:
    """The first failure any rank reports (None if none): one small collective that replaces a barrier."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return failure
    failures: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(failures, failure, group=group)
    return next((f"{f} (on rank {rank})" for rank, f in enumerate(failures) if f), None)


def from_main_process(value, group=None):
    """The main process's `value` on every rank (what it decided, so that all ranks act alike)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


def fsync_file(path: Path) -> None:
    """Flush a file (or a folder's entries) to disk, so a rename that follows publishes finished data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path, files: bool = True) -> None:
    """Flush `root` (a file, or a folder: every folder and, unless told not to, every file below it)."""
    if not root.is_dir():
        fsync_file(root)
    for folder, _, names in os.walk(root):
        for name in names if files else ():
            fsync_file(Path(folder) / name)
        fsync_file(Path(folder))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
