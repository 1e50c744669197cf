"""The fine-tuning loss without the whole logits (common.pretrained.target_token_losses) equals the loss from the
whole [batch, seq, vocab] logits, value and gradients, on 1 process, 2 DDP ranks and 2 FSDP2 ranks (CPU, gloo), for
full fine-tuning and LoRA (its default targets, and targets that wrap the output layer, tied or not), and the ranks
train what 1 process trains (the same parameters, losses and averaged gradients). The launched
tests/chunked_loss_probe.py computes both on each rank's batch and writes what it found."""

from __future__ import annotations

import json
import math

import pytest
from conftest import REPO, launch

PROBE = REPO / "tests" / "chunked_loss_probe.py"
LAUNCHES = {"1 process": ("cpu.yaml", None, ()),
            "2 DDP ranks": ("cpu_ddp.yaml", 2, ()),
            "2 FSDP2 ranks": ("fsdp.yaml", 2, ("--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer"))}


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_tiny_model(tmp_path_factory.mktemp("untied") / "tiny", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def found(tiny_model, untied_model, tmp_path_factory):
    """What the probe wrote, per launch (each launched once for every test here)."""
    results = {}
    for launched, (config, processes, launcher) in LAUNCHES.items():
        out = tmp_path_factory.mktemp("found")
        result = launch(config, PROBE, str(tiny_model), str(untied_model), str(out / "found"),
                        num_processes=processes, launcher_args=launcher, timeout=400)
        assert result.returncode == 0, (launched, result.stderr[-3000:])
        results[launched] = [r for path in sorted(out.glob("found.rank*.json")) for r in json.loads(path.read_text())]
    return results


MODELS = {"full", "lora", "lora-output-layer-tied", "full-untied", "lora-output-layer-untied"}


@pytest.mark.parametrize("launched", LAUNCHES)
def test_chunked_loss_equals_the_loss_of_the_whole_logits(launched, found):
    processes = LAUNCHES[launched][1] or 1
    expected = {(model, rank) for model in MODELS for rank in range(processes)}
    assert {(r["model"], r["rank"]) for r in found[launched]} == expected
    for r in found[launched]:
        assert r["processes"] == processes and r["targets"] > 4, r  # several chunks of 4
        assert math.isclose(r["chunked"], r["whole"], rel_tol=2e-6), r
        assert r["same_grads"] and r["trained"] > 0, r
        assert r["grad_max_diff"] <= 1e-5 * max(1.0, r["grad_max"]), r  # fp32 sums in another order
        assert r["per_token_max_diff"] <= 1e-5 and r["rows_match"], r
        assert r["empty_loss"] == 0.0 and r["empty_grad_max"] == 0.0, r


@pytest.mark.parametrize("launched", ["2 DDP ranks", "2 FSDP2 ranks"])
def test_ranks_train_the_model_one_process_trains(launched, found):
    """The same parameters trained (an output layer of its own stays its own: 21 tensors, not the 20 of a tied one),
    rank 0's loss on its batch equal to 1 process's on the same batch, and each parameter's gradient averaged over
    the ranks' batches equal to 1 process's average of the two batches, for every model."""
    alone = {r["model"]: r for r in found["1 process"]}
    assert alone["full-untied"]["trained"] == alone["full"]["trained"] + 1, alone
    for r in found[launched]:
        reference = alone[r["model"]]
        assert r["trained"] == reference["trained"], (r["model"], r["trained"], reference["trained"])
        norms, expected = r["grad_norms_over_two_ranks"], reference["grad_norms_over_two_ranks"]
        assert sorted(norms) == sorted(expected), r["model"]
        for name, norm in expected.items():
            assert math.isclose(norms[name], norm, rel_tol=1e-4, abs_tol=1e-6), (r["model"], name, norms[name], norm)
        if r["rank"] == 0:
            assert math.isclose(r["whole"], reference["whole"], rel_tol=1e-5), (r["model"], r["whole"], reference)


@pytest.mark.parametrize("changed", [False, True])
def test_logits_changed_after_the_output_layer_are_used_whole(tiny_model, changed):
    """A model whose forward changes the logits its output layer made (Gemma 2's soft cap, here a scale) is seen
    doing so at its first batch and gets its loss from the whole logits, as it returns them; mixed precision's
    upcast of the returned logits (accelerate's convert_outputs_to_fp32) is no change."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from common.pretrained import target_token_losses

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    if changed:
        model.register_forward_hook(lambda module, args, output: output.__setitem__("logits", output.logits * 3))
    else:  # the upcast accelerate applies to the outputs of a model under mixed precision
        model.register_forward_hook(lambda module, args, output: output.__setitem__("logits", output.logits.double()))
    input_ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    labels = input_ids.clone()
    labels[:, :4] = -100
    for _ in range(2):  # the first batch decides, the second follows
        loss = target_token_losses(model, labels, -100, chunk=3, input_ids=input_ids)
        whole = F.cross_entropy(model(input_ids=input_ids).logits[:, :-1].flatten(0, 1).float(),
                                labels[:, 1:].flatten(), reduction="sum")
        assert torch.allclose(loss, whole, rtol=1e-5), (loss, whole)
    assert model._logits_are_the_output_layers is not changed
