"""Refuse a checkpoint whose pickles hold anything but plain data, before anything unpickles them, so a downloaded
checkpoint cannot run code. accelerate and torch.distributed.checkpoint pickle `optimizer.bin`, `scheduler.bin`,
`scaler.pt`, `random_states_<rank>.pkl` and, under FSDP, each sharded folder's `.metadata` and the non-tensor
entries of its `.distcp` files; the weights themselves are safetensors."""

from __future__ import annotations

import io
import pickle
import re
import warnings
import zipfile
from pathlib import Path

import torch

from common.errors import UsageError, one_line

PICKLE_SUFFIXES = (".bin", ".pkl", ".pt", ".pth")
# What torch.distributed.checkpoint pickles into a `.metadata`: its own dataclasses, torch.Size, dtypes, layouts, paths
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _DCP_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


def check_pickles(path: Path) -> None:
    """Refuse a checkpoint folder if one of its pickles holds anything but plain data (tensors, numbers, RNG states):
    each is opened with torch's weights-only unpickler (plus the numpy types accelerate allows for RNG states),
    memory-mapped; a sharded folder's `.metadata` with an allowlist of torch's checkpoint classes."""
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    for file in sorted(path.iterdir()):
        try:
            with warnings.catch_warnings():  # torch warns about pickle protocols of files it then refuses
                warnings.simplefilter("ignore")
                if file.is_file() and file.suffix in PICKLE_SUFFIXES:
                    with torch.serialization.safe_globals(TORCH_SAFE_GLOBALS):
                        torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
                elif file.is_dir() and (file / ".metadata").is_file():
                    _check_sharded(file)
        except pickle.UnpicklingError as error:
            raise UsageError(f"checkpoint {path}: refused {file.relative_to(path)}: it holds more than plain data, "
                             f"loading it could run code ({_unpickling_reason(error)})") from None
        except (RuntimeError, ValueError, EOFError, OSError, KeyError, AttributeError) as error:
            raise UsageError(f"checkpoint {path}: refused {file.relative_to(path)}: "
                             f"unreadable ({one_line(error)})") from None


def _check_sharded(folder: Path) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with (folder / ".metadata").open("rb") as handle:
        metadata = _MetadataUnpickler(handle).load()
    kinds = getattr(metadata, "state_dict_metadata", None)
    entries = getattr(metadata, "storage_data", None)
    if not isinstance(kinds, dict) or not isinstance(entries, dict):
        raise ValueError(".metadata is not a torch.distributed.checkpoint index")
    for index, info in entries.items():
        if not isinstance(kinds.get(index.fqn), BytesStorageMetadata):
            continue  # tensors are raw bytes, read without unpickling
        if Path(info.relative_path).name != info.relative_path or getattr(info, "transform_descriptors", None):
            raise ValueError(f"entry {index.fqn} points outside the folder or is transformed")
        with (folder / info.relative_path).open("rb") as handle:
            handle.seek(info.offset)
            data = handle.read(info.length)
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)  # torch.distributed.checkpoint would not


def _unpickling_reason(error: BaseException) -> str:
    """What torch's weights-only unpickler refused ("Unsupported global: GLOBAL os.system ..."), without its
    advice to load the file unsafely (`weights_only=False`) or to allowlist the culprit."""
    text = str(error).split("WeightsUnpickler error:")[-1]  # newer torch: after its two options of unsafe loading
    for line in (line.strip() for line in text.splitlines()):
        if line and not line.startswith(("Weights only load failed", "Please file an issue", "Check the documentation",
                                         "(1)", "(2)")):
            reason = re.split(r"\.? Please use `", line)[0].rstrip(".")
            return "an object it does not allow" if "weights_only" in reason else reason
    return type(error).__name__
