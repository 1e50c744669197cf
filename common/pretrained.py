"""Training a big pretrained model (the fine-tuning template's mechanism; the model, dtype and LoRA config stay in the
template): its tokenizer and config checked before anything is written, loaded under FSDP2 with one full copy per
machine, checkpoints of only the trained parameters (a LoRA adapter), and greedy answers to prompts while it trains."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.checkpoint import checkpoint

from common.errors import UsageError


def gguf_source(name: str) -> tuple[str, dict]:
    """Where transformers finds --model: (name, {}), or for a .gguf file (folder, {"gguf_file": file name}), refused
    in one line if the file is missing, is not GGUF or the `gguf` package that reads it is not installed."""
    if not name.lower().endswith(".gguf"):
        return name, {}
    path = Path(name)
    if not path.is_file():
        raise UsageError(f"--model {name}: no such file")
    with path.open("rb") as file:
        if file.read(4) != b"GGUF":  # every GGUF file starts with these 4 bytes
            raise UsageError(f"--model {name}: not a GGUF file (it does not start with the GGUF magic bytes)")
    if importlib.util.find_spec("gguf") is None:
        raise UsageError(f"--model {name}: transformers reads .gguf files with the gguf package: pip install gguf")
    return str(path.resolve().parent), {"gguf_file": path.name}


def from_pretrained_call(name: str) -> str:
    """How a user loads --model in Python (what a LoRA adapter exported from it goes onto)."""
    where, gguf = gguf_source(name)
    where = str(Path(where).resolve()) if Path(where).is_dir() else where  # a local folder from any working folder
    return f"AutoModelForCausalLM.from_pretrained({where!r}" + "".join(f", {k}={v!r}" for k, v in gguf.items()) + ")"


def load_tokenizer_and_config(name: str):
    """The tokenizer and config of --model (a Hub id, folder or .gguf file), refused if missing or not a causal LM."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as transformers_logging

    if not (sys.stdout.isatty() or sys.stderr.isatty()):  # a log file: its bars (loading, writing) would be fragments
        transformers_logging.disable_progress_bar()
    where, gguf = gguf_source(name)
    try:
        config = AutoConfig.from_pretrained(where, **gguf)  # GGUF: an architecture transformers lacks is a ValueError
        if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise UsageError(f"--model {name}: a {config.model_type!r} model is not a causal language model")
        tokenizer = AutoTokenizer.from_pretrained(where, **gguf)  # a GGUF's chat template included
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"--model {name}: cannot load it ({str(error).splitlines()[0]})") from None
    if tokenizer.eos_token_id is None:
        raise UsageError(f"--model {name}: its tokenizer has no end-of-sequence token to end completions with")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked: any id works
    return tokenizer, config


def load_pretrained(name: str, config, dtype: torch.dtype) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_pretrained(name)` in `dtype`. A .gguf file's weights are dequantized into a plain
    model that trains and that `save_pretrained` writes (transformers would flag it quantized, refuse to save it and,
    with the `kernels` package, keep the weights packed). `config` spares parsing the file's metadata again."""
    from transformers import AutoModelForCausalLM

    where, gguf = gguf_source(name)
    if not gguf:
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    try:
        from transformers import GgufConfig  # recent transformers: asked to unpack every weight at load time
        gguf["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older ones always did
        pass
    model = AutoModelForCausalLM.from_pretrained(where, config=config, dtype=dtype, **gguf)
    if getattr(model, "hf_quantizer", None) is not None:  # dequantized, yet flagged: what save_pretrained refuses
        model.hf_quantizer.remove_quantization_config(model)
    return model


def render_chat(tokenizer, messages: list[dict], end: int, add_generation_prompt: bool = False) -> str:
    """messages[:end] through the tokenizer's chat template (text), or a UsageError naming the first one it refuses."""
    try:
        return tokenizer.apply_chat_template(messages[:end], tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as error:  # jinja2's TemplateError (the template's raise_exception) or any other
        first = next((i for i in range(end) if _refuses(tokenizer, messages[:i + 1])), max(end - 1, 0))
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(f"the chat template of --model refuses message {first + 1} "
                         f"(role {messages[first]['role']!r}): {reason}") from None


def _refuses(tokenizer, messages: list[dict]) -> bool:
    try:
        tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:
        return True
    return False


def check_lora_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Refuse --lora_target_modules that name no module of the model, listing its linear layers."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t != "all-linear" and t not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise UsageError(f"--lora_target_modules: the model has no module named {', '.join(missing)} "
                         f"(its linear layers: {', '.join(linear)})")


def load_once_per_machine(accelerator: Accelerator, pretrained: Callable[[], torch.nn.Module],
                          empty: Callable[[], torch.nn.Module],
                          adapt: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
    """`adapt(pretrained())`: the model to train. Under FSDP only rank 0 reads the weights (and draws what `adapt`
    draws: LoRA's initial adapter): every rank builds `empty()` on the meta device, adapts and shards it, and rank 0
    broadcasts its weights into the shards, so a machine holds one full copy while loading instead of one per rank."""
    from accelerate import init_empty_weights
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        return adapt(pretrained())
    full_state = adapt(pretrained()).state_dict() if accelerator.is_main_process else {}
    with init_empty_weights(include_buffers=False):  # buffers stay real: the rotary inv_freq is computed, not loaded
        model = empty()
    model.tie_weights()  # from_config on meta leaves a tied output layer untied; ties only where the config ties
    model = adapt(model)
    shard_and_broadcast(model, full_state, accelerator)
    return model


def shard_and_broadcast(model: torch.nn.Module, full_state: dict, accelerator: Accelerator) -> None:
    """FSDP2 on a meta model (buffers real): a unit per layer class of the launch config and the root, local shards
    filled by broadcast from rank 0's `full_state` (others pass {}), ready for `accelerator.prepare`. Not accelerate's
    cpu_ram_efficient_loading, which keeps each full tensor it receives alive (bench/finetune_loading.py)."""
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
    # No tie_weights() here: the ties made on the meta model survive to_empty and this in-place load, and a second
    # one on the adapted model would set `lm_head.weight` on a LoRA wrapper of the output layer (which refuses)
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    full_state.clear()
    for name, value in computed.items():
        model.get_buffer(name).copy_(value)


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each layer's activations in backward (non-reentrant), by the new name where the old one warns."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def keep_only_trained_in_checkpoints(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """A checkpoint holds the trained parameters (LoRA: the adapter) and their optimizer state, not the frozen rest.
    Call after `accelerator.prepare`. Under FSDP accelerate writes each rank's shard of the whole model itself."""
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


LOSS_CHUNK = 256  # target tokens whose logits exist at once: [256, vocab] in fp32, as TRL's chunked loss


def target_token_losses(model: torch.nn.Module, labels: torch.Tensor, ignore_index: int, *, per_token: bool = False,
                        chunk: int = LOSS_CHUNK, **inputs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy of each target token (position t predicts labels[:, t + 1] where that is not ignore_index),
    in fp32, without the [batch, seq, vocab] logits: summed (a scalar), or per token with the batch row of each.

    The model runs its own forward (DDP, FSDP2, autocast, LoRA as usual) with its output layer fed zero positions
    (the last one at the first batch, to check the logits); the output layer is then applied to the hidden states of the
    target positions only, `chunk` at a time, each chunk's fp32 logits dropped after its loss (recomputed in backward).
    A model that returns other logits than its output layer made (a soft cap) gets the whole logits from then on."""
    targets = labels[:, 1:]
    rows, positions = (targets != ignore_index).nonzero(as_tuple=True)
    picked = targets[rows, positions]
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    seen: dict = {}
    checked = getattr(inner, "_logits_are_the_output_layers", None)  # None: not yet seen
    if head is not None and checked is not False:
        fed = slice(-1, None) if checked is None else slice(0, 0)  # the output layer's positions: last, or none

        def keep_hidden(module, args):
            seen["hidden"], seen["autocast"] = args[0], _autocast_state(args[0].device.type)
            return (args[0][..., fed, :], *args[1:])

        hooks = [head.register_forward_pre_hook(keep_hidden),
                 head.register_forward_hook(lambda module, args, output: seen.update(output=output))]
        try:
            output = model(**inputs)
        finally:
            for hook in hooks:
                hook.remove()
        if checked is None:  # the first batch: the last position's logits, as the output layer made them?
            checked = inner._logits_are_the_output_layers = (
                "hidden" in seen and seen["hidden"].shape[:-1] == labels.shape
                and torch.equal(output.logits.float(), seen["output"].float()))
        if not checked:
            seen.clear()
    if "hidden" not in seen:
        logits = model(**inputs).logits[:, :-1][rows, positions]
        losses = _chunk_loss(lambda x: x, logits, picked, per_token)
        return (losses, rows) if per_token else losses
    hidden = seen["hidden"][:, :-1][rows, positions]  # [targets, hidden size]
    device_type, autocast = seen["autocast"]
    losses = []
    with torch.autocast(device_type, **autocast):  # as the model's forward ran (accelerate's mixed precision)
        for start in range(0, max(len(picked), 1), chunk):  # an empty chunk still joins the graph: DDP waits for it
            args = (head, hidden[start:start + chunk], picked[start:start + chunk], per_token)
            last = start + chunk >= len(picked)
            recompute = torch.is_grad_enabled() and not last  # the last chunk's logits are the only ones kept
            losses.append(checkpoint(_chunk_loss, *args, use_reentrant=False) if recompute else _chunk_loss(*args))
    if not per_token:
        return torch.stack(losses).sum() if len(losses) > 1 else losses[0]
    return torch.cat(losses), rows


def _chunk_loss(head, hidden: torch.Tensor, targets: torch.Tensor, per_token: bool) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="none" if per_token else "sum")


def _autocast_state(device_type: str) -> tuple[str, dict]:
    if not torch.amp.is_autocast_available(device_type):
        return "cpu", {"enabled": False}
    return device_type, {"enabled": torch.is_autocast_enabled(device_type),
                         "dtype": torch.get_autocast_dtype(device_type)}


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: list[list[int]], new_tokens: list[int], eos_id: int, pad_id: int,
             device) -> list[list[int]]:
    """Greedy answers to all `prompts` at once, each up to its `new_tokens` and cut before its EOS: one batch with the
    KV cache (asked for here: training turns it off): the prompts left-padded (masked, positions
    counting from each one's own first token), one forward over them, then one per new token, only the last
    position's logits computed; `max(new_tokens)` forwards whatever the answers, as many on every rank (FSDP)."""
    if not prompts or max(new_tokens, default=0) <= 0:
        return [[] for _ in prompts]
    training = model.training
    model.eval()
    longest = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[pad_id] * (longest - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    written, cache = [], {}
    for _ in range(max(new_tokens)):
        positions = (mask.cumsum(1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        output = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                       **cache)
        # the cache comes back as `cache` (transformers 5.25 on) or `past_key_values` (before), and goes in so
        key = "cache" if output.get("cache") is not None else "past_key_values"
        cache = {key: output[key]}
        ids = output.logits[:, -1:].argmax(-1)
        written.append(ids)
        mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    model.train(training)
    answers = []
    for tokens, count in zip(torch.cat(written, dim=1).tolist(), new_tokens):
        tokens = tokens[:count]
        answers.append(tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens)
    return answers


def answer_probes(model: torch.nn.Module, probes: list[tuple[list[int], list[int]]], tokenizer,
                  device) -> tuple[list[dict[str, str]], float]:
    """Greedy answers to the probe prompts, (prompt, expected answer) pairs (as many tokens as the expected answer,
    and its EOS; all in one batch), and the share that matches the expected answer exactly."""
    outputs = generate(model, [prompt for prompt, _ in probes], [len(expected) + 1 for _, expected in probes],
                       tokenizer.eos_token_id, tokenizer.pad_token_id, device)
    rows = [{"prompt": tokenizer.decode(prompt), "output": tokenizer.decode(output),
             "expected": tokenizer.decode(expected)} for (prompt, expected), output in zip(probes, outputs)]
    matches = sum(output == expected for (_, expected), output in zip(probes, outputs))
    return rows, matches / max(1, len(probes))
