"""Training a big pretrained model: load it under FSDP2 with one full copy per machine, and checkpoint only the
parameters that train (a LoRA adapter), not the frozen rest.

Mechanism the fine-tuning template uses and a user does not edit: which model, its dtype and the LoRA config stay in
the template. Both follow accelerate's FSDP2 plugin and its save/load-state hooks (accelerate 1.16); neither is
about language models.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator


def shard_and_broadcast(model: torch.nn.Module, full_state: dict, accelerator: Accelerator) -> None:
    """FSDP2 on a meta model: one unit per layer class of the launch config (fsdp_transformer_layer_cls_to_wrap)
    plus the root, local shards allocated, then filled from rank 0's full state dict by broadcast.

    Every rank builds `model` on the meta device (buffers real); rank 0 alone holds `full_state` (the others pass
    {}), so a machine holds one full copy while loading instead of one per rank. accelerate's own
    cpu_ram_efficient_loading keeps each received full tensor alive behind its shard (a view): measured 0.83-0.90x
    of the model per rank on 2 ranks instead of ~0.5x (bench/finetune_loading.py). `accelerator.prepare` then
    takes the sharded model as it is.
    """
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    plugin = accelerator.state.fsdp_plugin
    plugin.set_auto_wrap_policy(model)  # refuses a layer class the model does not have
    is_unit = fsdp2_prepare_auto_wrap_policy(plugin, model)
    options = dict(offload_policy=plugin.cpu_offload, mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy())
    for module in reversed(list(model.modules())):  # innermost first
        if module is not model and is_unit is not None and is_unit(module):
            fully_shard(module, reshard_after_forward=plugin.reshard_after_forward, **options)
    fully_shard(model, **options)
    computed = {}  # non-persistent buffers (rotary inv_freq): not in any state dict, garbage after to_empty
    for prefix, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            computed[f"{prefix}.{name}" if prefix else name] = module.get_buffer(name).clone()
    model.to_empty(device=accelerator.device)
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    full_state.clear()
    for name, value in computed.items():
        model.get_buffer(name).copy_(value)
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def keep_only_trained_in_checkpoints(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """A checkpoint holds the trained parameters (LoRA: the adapter) and their optimizer state, not the frozen rest.

    Call after `accelerator.prepare`. Under FSDP accelerate writes each rank's shard of the whole model itself
    (these hooks do not see it).
    """
    trained = {name for name, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad}

    def save_hook(models, weights, output_dir):
        for state_dict in weights:
            for key in [k for k in state_dict if k.removeprefix("module.") not in trained]:
                del state_dict[key]

    def load_hook(models, input_dir):
        from safetensors.torch import load_file

        for wrapped in models:
            state_dict = {k.removeprefix("module."): v for k, v in load_file(f"{input_dir}/model.safetensors").items()}
            result = accelerator.unwrap_model(wrapped).load_state_dict(state_dict, strict=False)
            if result.unexpected_keys or trained - set(state_dict):
                raise ValueError(f"adapter checkpoint does not fit: unexpected {result.unexpected_keys[:3]}, "
                                 f"missing {sorted(trained - set(state_dict))[:3]}")
        models.clear()  # loaded here: accelerate must not load them again, strictly

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
