"""Launched by tests/test_chunked_loss.py on 1 process, 2 DDP ranks or 2 FSDP2 ranks (CPU, gloo):

    accelerate launch --config_file accelerate_configs/<config> tests/chunked_loss_probe.py <tiny> <untied> <out>

For full fine-tuning and LoRA on the tiny model (tied embeddings), LoRA that wraps its output layer (tied to the
embedding: SmolLM2's case), and on one with an output layer of its own full fine-tuning and LoRA that wraps that output
layer too (explicit targets; peft's all-linear leaves it out), each built from its own folder's config and prepared as
the fine-tuning template does, it computes on this rank's batch the loss of its target tokens twice:
with `common.pretrained.target_token_losses` (chunks of 4 targets, so several chunks and recomputation) and from the
whole logits (F.cross_entropy over [batch, seq, vocab], the template's loss before), each followed by a backward,
and writes to <out>.rank<N>.json, per model, both losses and the largest gradient difference (full tensors
under FSDP2), and the norm of each parameter's gradient of the whole loss averaged over 2 ranks' batches (on 1
process both batches are computed here), for the test to compare across launches. It also compares the per-token
losses of an evaluation, and checks that a micro-batch without a single target token gives a zero loss whose
backward completes on every rank (DDP waits for every gradient).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.accelerator import build_accelerator  # noqa: E402
from common.pretrained import target_token_losses  # noqa: E402

IGNORE = -100


def load_template():
    spec = importlib.util.spec_from_file_location("finetune_template", REPO / "templates" / "finetune_causal_lm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def rank_batch(rank: int, vocab: int) -> dict[str, torch.Tensor]:
    """Three rows of 14 tokens, the last two padded, each row's targets after a prompt of its own length."""
    generator = torch.Generator().manual_seed(100 + rank)
    input_ids = torch.randint(3, vocab, (3, 14), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 11:] = attention_mask[2, 9:] = 0
    labels = input_ids.clone()
    for row, prompt in enumerate((3 + rank, 6, 2 + 2 * rank)):
        labels[row, :prompt] = IGNORE
    labels[attention_mask == 0] = IGNORE
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def full_grads(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            grad = parameter.grad
            grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    model.zero_grad(set_to_none=True)
    return grads


def main() -> None:
    model_dir, untied_dir, out = sys.argv[1:4]
    results = []
    template = load_template()
    accelerator = build_accelerator(seed=0)
    from transformers import AutoConfig

    batch = rank_batch(accelerator.process_index, AutoConfig.from_pretrained(model_dir).vocab_size)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
    lora = {"lora_r": 4, "lora_dropout": 0.0}
    output_layer = lora | {"lora_target_modules": ["q_proj", "v_proj", "lm_head"]}
    for name, folder, options in (("full", model_dir, {}), ("lora", model_dir, lora),
                                  ("lora-output-layer-tied", model_dir, output_layer),
                                  ("full-untied", untied_dir, {}),
                                  ("lora-output-layer-untied", untied_dir, output_layer)):
        torch.manual_seed(0)
        cfg = template.Config(model=folder, data_path="unused", **options)
        config = AutoConfig.from_pretrained(folder)  # as the template does: the config of --model itself
        model = accelerator.prepare(template.load_model(cfg, accelerator, config))
        if name != "full":  # LoRA's B starts at zero: a gradient of the base path alone would hide a wrong head
            with torch.no_grad():
                for parameter_name, parameter in model.named_parameters():
                    if "lora_B" in parameter_name:
                        parameter.add_(0.05)
        model.train()
        chunked = target_token_losses(model, batch["labels"], IGNORE, chunk=4, **inputs)
        chunked.backward()
        chunked_grads = full_grads(model)
        logits = model(**inputs).logits
        whole = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                                ignore_index=IGNORE, reduction="sum")
        whole.backward()
        whole_grads = full_grads(model)
        over_two_ranks = whole_grads  # DDP and FSDP2 average the gradients of the ranks' batches
        if accelerator.num_processes == 1:
            other = rank_batch(1, config.vocab_size)
            F.cross_entropy(model(input_ids=other["input_ids"], attention_mask=other["attention_mask"],
                                  use_cache=False).logits[:, :-1].flatten(0, 1).float(),
                            other["labels"][:, 1:].flatten(), ignore_index=IGNORE, reduction="sum").backward()
            over_two_ranks = {k: (g + whole_grads[k]) / 2 for k, g in full_grads(model).items()}
        with torch.no_grad():
            per_token, rows = target_token_losses(model, batch["labels"], IGNORE, per_token=True, chunk=4, **inputs)
            reference = F.cross_entropy(model(**inputs).logits[:, :-1].transpose(1, 2).float(),
                                        batch["labels"][:, 1:], ignore_index=IGNORE, reduction="none")
            mask = batch["labels"][:, 1:] != IGNORE
        nothing = torch.full_like(batch["labels"], IGNORE)  # a micro-batch without a target token
        empty = target_token_losses(model, nothing, IGNORE, chunk=4, **inputs)
        empty.backward()
        empty_grads = full_grads(model)
        result = {
            "model": name, "rank": accelerator.process_index, "processes": accelerator.num_processes,
            "distributed": str(accelerator.distributed_type), "targets": int(mask.sum()),
            "chunked": chunked.item(), "whole": whole.item(), "trained": len(whole_grads),
            "same_grads": sorted(chunked_grads) == sorted(whole_grads),
            "grad_max_diff": max((chunked_grads[k] - whole_grads[k]).abs().max().item() for k in whole_grads),
            "grad_max": max(g.abs().max().item() for g in whole_grads.values()),
            "grad_norms_over_two_ranks": {k.removeprefix("module."): g.norm().item()
                                          for k, g in over_two_ranks.items()},
            "per_token_max_diff": (per_token - reference[mask]).abs().max().item(),
            "rows_match": torch.equal(rows, mask.nonzero()[:, 0]),
            "empty_loss": empty.item(), "empty_grad_max": max(g.abs().max().item() for g in empty_grads.values()),
        }
        results.append(result)
    Path(f"{out}.rank{accelerator.process_index}.json").write_text(json.dumps(results))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
