"""Background checkpoint writes: what `accelerator.save_state` would write, copied to host memory at the step and
written by a thread while training goes on. Mirrors accelerate 1.16's `Accelerator.save_state` and the RNG file of
`checkpointing.save_accelerator_state`, file by file (pinned byte for byte by tests/test_checkpoint.py), so `load_state`
reads either kind. Re-read it on an accelerate or torch upgrade: it uses private attributes and functions of both,
imported where used, so on a release without one `cannot_mirror` names it and the run saves at the step instead."""

from __future__ import annotations

import importlib
import random
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.data_loader import IterableDatasetShard
from accelerate.state import PartialState
from accelerate.utils import DistributedType, clean_state_dict_for_safetensors
from accelerate.utils.constants import (FSDP_MODEL_NAME, OPTIMIZER_NAME, RNG_STATE_NAME, SAFE_WEIGHTS_NAME, SCALER_NAME,
                                        SCHEDULER_NAME)
from safetensors.torch import save_file

WRITER_THREAD = "checkpoint-writer"  # the name of the thread writing a checkpoint (common.accelerator waits for it)
# The private names this mirror uses, by module; and the Accelerator's private attributes it reads.
_PRIVATE = {"accelerate.utils.fsdp_utils": ("_get_model_state_dict", "_prepare_sd_options", "_unwrap_optimizer"),
            "accelerate.checkpointing": ("get_torch_accelerator_backend",),
            "torch.distributed._state_dict_utils": ("_check_state_dict_similarity", "_copy_state_dict",
                                                    "_create_cpu_state_dict")}
_ACCELERATOR_PRIVATE = ("_models", "_optimizers", "_schedulers", "_save_model_state_pre_hook", "_custom_objects",
                        "_dataloaders")


class BackgroundSave:
    """One checkpoint being written by a thread; `finish()` joins it and raises what went wrong there."""

    def __init__(self, names: list[str], write, args: tuple, hold: list | None = None):
        self.names = names
        self.error: BaseException | None = None  # set when the write ended in an error
        self.failed_somewhere = False  # set at a step's check when the write failed on any rank
        self._thread = threading.Thread(target=self._run, args=(write, *args), name=WRITER_THREAD)
        self._thread.start()
        # Optimizers whose parameters and state it writes in place (Snapshot.in_place): their next step waits for it
        self._holds = [getattr(optimizer, "optimizer", optimizer).register_step_pre_hook(
            lambda *_: self._thread.join()) for optimizer in hold or []]

    def _run(self, write, *args) -> None:
        try:
            write(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the training thread, which raises it
            self.error = error

    def finish(self, raise_error: bool = True) -> None:
        self._thread.join()
        for handle in self._holds:
            handle.remove()
        error, self.error = self.error, None
        if error is not None and raise_error:
            raise error


def finish_background_saves() -> None:
    """Join the checkpoint writes in flight in this process (before freeing the process group: they run collectives)."""
    for thread in threading.enumerate():
        if thread.name == WRITER_THREAD:
            thread.join()


def cannot_mirror(accelerator: Accelerator) -> str:
    """Why a background save could not write what save_state writes for this run ("" if it can)."""
    for module, names in _PRIVATE.items():
        try:
            found = importlib.import_module(module)
        except ImportError:
            found = None
        if missing := [name for name in names if not hasattr(found, name)]:
            package = module.split(".")[0]
            return f"{package} {importlib.import_module(package).__version__} has no {module}.{missing[0]}"
    if missing := [name for name in _ACCELERATOR_PRIVATE if not hasattr(accelerator, name)]:
        return f"accelerate {importlib.import_module('accelerate').__version__} has no Accelerator.{missing[0]}"
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

    supported = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.FSDP)
    if accelerator.distributed_type not in supported:
        return f"{accelerator.distributed_type} saves through its own engine"
    plugin = _fsdp_plugin(accelerator)
    if plugin is not None and (plugin.fsdp_version != 2 or plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT):
        return "FSDP other than version 2 with fsdp_state_dict_type: SHARDED_STATE_DICT"
    if accelerator._custom_objects:
        return "objects registered with accelerator.register_for_checkpointing"
    if any(isinstance(loader.dataset, IterableDatasetShard) or getattr(loader, "use_stateful_dataloader", False)
           for loader in accelerator._dataloaders):
        return "a data loader whose position accelerate saves"
    return ""


def writer_group(accelerator: Accelerator, timeout_s: float):
    """The background writer's own process group (None on one process): its collectives (agreeing on failures, FSDP's
    sharded writes) run while training's run, and two threads sharing one gloo group mix up each other's messages."""
    if accelerator.num_processes > 1 and dist.is_initialized():
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return None


IN_HOST_MEMORY = ("cpu",)  # devices whose training state is in host memory already: a copy there would double it


def snapshot_state(accelerator: Accelerator, folder: Path, host_copy: HostCopy, copy: bool = True) -> Snapshot:
    """What accelerate's save_state would write into `folder` on this rank, copied to host memory now (the part of a
    background save at the step), for a run `cannot_mirror` accepts. `copy` False (nothing trains after this save):
    the state dicts as they are, `host_copy`'s buffers let go. On a device IN_HOST_MEMORY (without FSDP) parameters
    and optimizer state as they are too, the next optimizer step waiting for the write; buffers (which forward may
    change) copied."""
    from accelerate.utils.fsdp_utils import _get_model_state_dict, _prepare_sd_options, _unwrap_optimizer
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    plugin = _fsdp_plugin(accelerator)
    state = PartialState()
    writes = state.is_local_main_process if accelerator.project_configuration.save_on_each_node \
        else state.is_main_process  # where accelerate's save() writes model, optimizer and schedulers
    files: list[tuple[str, str, object]] = []
    sharded: list[tuple[str, str, dict]] = []
    weights = []
    for i, model in enumerate(accelerator._models):
        if plugin is None:
            weights.append(accelerator.get_state_dict(model, unwrap=False))
        else:
            model_state = _get_model_state_dict(model, sd_options=_prepare_sd_options(plugin))
            sharded.append((f"{FSDP_MODEL_NAME}_{i}", "model", model_state))
    if plugin is not None:
        for i, optimizer in enumerate(accelerator._optimizers):
            optimizer_state = get_optimizer_state_dict(accelerator._models[i], _unwrap_optimizer(optimizer),
                                                       options=_prepare_sd_options(plugin))
            sharded.append((f"{OPTIMIZER_NAME}_{i}", "optimizer", optimizer_state))
    for hook in accelerator._save_model_state_pre_hook.values():
        hook(accelerator._models, weights, str(folder))
    if writes:
        for i, weights_of_model in enumerate(weights):
            if isinstance(weights_of_model, OrderedDict):  # as accelerate's save(): tied tensors once
                weights_of_model = clean_state_dict_for_safetensors(weights_of_model)
            files.append((_indexed(SAFE_WEIGHTS_NAME, i), "safetensors", weights_of_model))
        if plugin is None:
            for i, optimizer in enumerate(accelerator._optimizers):
                files.append((_indexed(f"{OPTIMIZER_NAME}.bin", i), "torch", optimizer.state_dict()))
        for i, scheduler in enumerate(accelerator._schedulers):
            files.append((_indexed(f"{SCHEDULER_NAME}.bin", i), "torch", scheduler.state_dict()))
        if accelerator.scaler is not None:
            files.append((SCALER_NAME, "torch", accelerator.scaler.state_dict()))
    files.append((f"{RNG_STATE_NAME}_{accelerator.process_index}.pkl", "rng", _rng_states(accelerator.step)))
    accelerator.project_configuration.iteration += 1  # as save_state counts its saves
    if not copy:
        host_copy.buffers.clear()
        return Snapshot(files, sharded)
    if accelerator.device.type in IN_HOST_MEMORY and plugin is None:
        host_copy.buffers.clear()
        parameters = {p.data_ptr() for model in accelerator._models for p in model.parameters()}
        in_place = [(name, kind, {key: tensor if tensor.data_ptr() in parameters else tensor.clone()
                                  for key, tensor in obj.items()} if kind == "safetensors" else obj)
                    for name, kind, obj in files if kind == "safetensors" or name.startswith(OPTIMIZER_NAME)]
        rest = [file for file in files if file[1] != "safetensors" and not file[0].startswith(OPTIMIZER_NAME)]
        return Snapshot(in_place + host_copy.snapshot(rest, []).files, [], in_place=True)
    return host_copy.snapshot(files, sharded)


def _fsdp_plugin(accelerator: Accelerator):
    return accelerator.state.fsdp_plugin if accelerator.distributed_type == DistributedType.FSDP else None


def _indexed(name: str, index: int) -> str:
    """accelerate's file name of the index-th model, optimizer or scheduler: model.safetensors, model_1.safetensors"""
    stem, dot, suffix = name.partition(".")
    return name if index == 0 else f"{stem}_{index}{dot}{suffix}"


def _rng_states(step: int) -> dict:
    """This rank's random number generators, as save_state writes them (random_states_<rank>.pkl)."""
    from accelerate.checkpointing import get_torch_accelerator_backend

    states = {"step": step, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
              "torch_manual_seed": torch.get_rng_state()}
    device_type, device_module = get_torch_accelerator_backend()
    if device_type is not None:
        key = f"torch_{device_type}_manual_seed"
        if device_module is torch.accelerator:
            if hasattr(torch.accelerator, "random"):
                states[key] = torch.accelerator.random.get_rng_state()
            else:
                states[key] = torch.get_device_module(device_type).get_rng_state()
        elif device_type == "mps":
            states[key] = device_module.get_rng_state()
        else:
            states[key] = device_module.get_rng_state_all()
    return states


@dataclass
class Snapshot:
    """A rank's part of a checkpoint in host memory: files (name, "safetensors" or "torch", object) and FSDP
    shards (folder, key, state dict) written with torch.distributed.checkpoint, as save_state writes them."""

    files: list[tuple[str, str, object]]
    sharded: list[tuple[str, str, dict]]
    in_place: bool = False  # the live parameters and optimizer state, not copies: no optimizer step until written

    def write(self, folder: Path, group) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        folder.mkdir(parents=True, exist_ok=True)
        for subfolder, key, state_dict in self.sharded:  # collectives first: every rank reaches them together
            (folder / subfolder).mkdir(exist_ok=True)
            dcp.save({key: state_dict}, storage_writer=dcp.FileSystemWriter(folder / subfolder),
                     planner=DefaultSavePlanner(), process_group=group)
        for name, kind, obj in self.files:
            if kind == "safetensors":
                save_file(obj, folder / name, metadata={"format": "pt"})
            else:  # "torch", "rng"
                torch.save(obj, folder / name)


class HostCopy:
    """Copies state dicts to host memory (pinned on a GPU) into buffers kept from one save to the next, so a
    save at the step costs one memory copy: no allocation, no serialisation, no disk."""

    def __init__(self, pin_memory: bool):
        self.pin_memory = pin_memory
        self.buffers: dict[str, dict] = {}

    def snapshot(self, files: list[tuple[str, str, object]], sharded: list[tuple[str, str, dict]]) -> Snapshot:
        copied = [(name, kind, self._copy(name, obj) if isinstance(obj, dict) and kind != "rng" else obj)
                  for name, kind, obj in files]  # the RNG states are taken fresh: nothing to copy
        shards = [(folder, key, self._copy(folder, state_dict)) for folder, key, state_dict in sharded]
        if self.pin_memory:
            torch.cuda.synchronize()  # the copies ran without blocking; they are complete from here on
        return Snapshot(copied, shards)

    def _copy(self, name: str, state_dict: dict) -> dict:
        # torch's own staging for torch.distributed.checkpoint's async_save: tensors and DTensor shards into
        # host buffers of the same structure; other values (numbers, lists) are taken as they are now.
        from torch.distributed._state_dict_utils import (_check_state_dict_similarity, _copy_state_dict,
                                                         _create_cpu_state_dict)

        buffer = self.buffers.get(name)
        if buffer is None or not _check_state_dict_similarity(state_dict, buffer):  # first save, or a new shape
            buffer = self.buffers[name] = _create_cpu_state_dict(state_dict, pin_memory=self.pin_memory)
        return _copy_state_dict(state_dict, buffer, non_blocking=self.pin_memory, type_check=False)
