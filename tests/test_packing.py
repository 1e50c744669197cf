"""The fine-tuning template's --packing (packed rows: common/data.py): rows packed best fit decreasing, each packed
example giving its unpacked logits and masked loss (SDPA and eager), a packed run resuming bit-exactly, and the
models whose attention would mix examples refused in one line."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from common.data import IGNORE, PackedCollate, PackedExamples, pack, unpackable
from conftest import load_template, start_clean_accelerate
from test_finetune import reverse_task, write_jsonl


def test_pack_puts_every_example_in_one_row_of_at_most_the_capacity_and_fills_rows():
    rng = random.Random(0)
    lengths = [rng.randint(5, 120) for _ in range(500)]
    rows = pack(lengths, 128)
    assert sorted(i for row in rows for i in row) == list(range(500))  # each example once
    assert all(sum(lengths[i] for i in row) <= 128 for row in rows)
    assert all(row == sorted(row) for row in rows)
    assert sum(lengths) / (128 * len(rows)) > 0.95  # best fit decreasing on mixed lengths
    assert pack(lengths, 128) == rows  # deterministic: the same rows every time, so a resume sees them again
    with pytest.raises(ValueError, match="example 1 has 9 tokens"):
        pack([3, 9], 8)


def test_collate_restarts_positions_at_each_example_and_never_learns_across_examples():
    rows = PackedExamples([([1, 2, 3], [-100, 2, 3]), ([4, 5], [4, 5]), ([6, 7, 8, 9], [6, 7, 8, 9])], capacity=5)
    batch = PackedCollate(pad_id=0)([rows[i] for i in range(len(rows))])
    assert len(rows) == 2 and batch["tokens"].item() == 9
    by_row = {tuple(ids): (pos, labels) for ids, pos, labels in zip(batch["input_ids"].tolist(),
                                                                    batch["position_ids"].tolist(),
                                                                    batch["labels"].tolist())}
    assert by_row[(1, 2, 3, 4, 5)] == ([0, 1, 2, 0, 1], [IGNORE, 2, 3, IGNORE, 5])
    assert by_row[(6, 7, 8, 9, 0)] == ([0, 1, 2, 3, 0], [IGNORE, 7, 8, 9, IGNORE])  # padding: a segment of its own
    assert "attention_mask" not in batch  # a mask would switch transformers' per-example attention off


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_each_packed_example_gives_its_unpacked_logits_and_masked_loss(tiny_model, attention):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module = load_template("finetune_causal_lm")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=attention).eval()
    pairs = [module.encode_completion(tokenizer, e["prompt"], e["completion"] * (1 + i % 4))
             for i, e in enumerate(reverse_task(12))]
    rows = PackedExamples(pairs, capacity=64)
    assert len(rows) < len(pairs)  # several examples share a row
    batch = PackedCollate(tokenizer.pad_token_id)([rows[i] for i in range(len(rows))])
    with torch.no_grad():
        # as the template runs a packed batch: position ids restarting at each example, no attention mask
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        packed_loss = module.target_losses(model, batch)
        unpacked_loss = 0.0
        for row, examples in enumerate(rows.rows):
            start = 0
            for index in examples:
                ids, labels = pairs[index]
                alone = model(input_ids=torch.tensor([ids])).logits[0]
                assert torch.allclose(logits[row, start:start + len(ids)], alone, atol=1e-5), (attention, row, index)
                unpacked_loss += module.target_losses(model, {"input_ids": torch.tensor([ids]),
                                                              "labels": torch.tensor([labels])})
                start += len(ids)
    assert torch.allclose(packed_loss, unpacked_loss, rtol=1e-5), (packed_loss, unpacked_loss)


def test_a_packed_run_trains_validates_like_an_unpacked_one_and_resumes_bit_exactly(tmp_path, tiny_model,
                                                                                      monkeypatch, capsys):
    """Stopped after 3 steps and resumed: the same weights as 6 packed steps in one go; the evaluation before
    training (one example a row) gives the unpacked run's validation loss."""
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "data.jsonl", reverse_task(300))
    common = ["--model", str(tiny_model), "--data_path", str(data), "--tracker", "none", "--max_steps", "6",
              "--batch_size", "2", "--max_length", "64", "--eval_every_steps", "0", "--sample_tokens", "0",
              "--learning_rate", "3e-3", "--warmup_steps", "2", "--gradient_accumulation_steps", "2"]
    for out, extra in (("whole", ("--packing", "true")), ("parts", ("--packing", "true", "--stop_after_steps", "3")),
                       ("parts", ("--packing", "true", "--resume", "auto")), ("unpacked", ())):
        start_clean_accelerate(monkeypatch)
        load_template("finetune_causal_lm").main([*common, "--output_dir", str(tmp_path / out), *extra])
    assert "training examples into" in capsys.readouterr().out
    whole, parts = (load_file(str(tmp_path / out / "model" / "model.safetensors")) for out in ("whole", "parts"))
    assert whole.keys() == parts.keys() and all((whole[k] == parts[k]).all() for k in whole)

    def first(out):
        return json.loads((tmp_path / out / "metrics.jsonl").read_text().splitlines()[0])

    assert first("whole")["val/tokens"] == first("unpacked")["val/tokens"]
    assert abs(first("whole")["val/loss"] - first("unpacked")["val/loss"]) < 1e-6


def test_models_whose_attention_would_mix_packed_examples_are_refused():
    assert unpackable(SimpleNamespace(_attn_implementation="sdpa", layer_types=["full_attention"] * 2)) is None
    assert unpackable(SimpleNamespace(_attn_implementation="eager")) is None
    hybrid = unpackable(SimpleNamespace(_attn_implementation="sdpa",
                                        layer_types=["linear_attention", "full_attention"]))
    assert "linear_attention layers would mix packed examples" in hybrid
    assert "attention implementation 'paged_attention'" in unpackable(SimpleNamespace(
        _attn_implementation="paged_attention"))


def test_packing_a_hybrid_model_is_one_error_line_and_nothing_written(tmp_path, tiny_model, monkeypatch, capsys):
    import shutil

    model = tmp_path / "hybrid"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    config["layer_types"] = ["linear_attention"] + ["full_attention"] * (config["num_hidden_layers"] - 1)
    (model / "config.json").write_text(json.dumps(config))
    data = write_jsonl(tmp_path / "data.jsonl", reverse_task(50))
    start_clean_accelerate(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        load_template("finetune_causal_lm").main(["--model", str(model), "--data_path", str(data), "--output_dir",
                                                  str(tmp_path / "out"), "--tracker", "none", "--packing", "true",
                                                  "--batch_size", "1"])
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: --packing: ") and "linear_attention" in errors[0], errors
    assert not (tmp_path / "out").exists()
