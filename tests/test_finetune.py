"""templates/finetune_causal_lm.py: loss masking, padding and chat rendering in-process; real `accelerate launch`
runs of a tiny Llama-architecture model (scripts/make_tiny_model.py, written offline) on 1 process, 2 DDP and
2 FSDP2 ranks, full and LoRA, on a task whose answer depends on the prompt (reverse a word); the export loads
with from_pretrained in a plain process and gives the trained model's logits; bad input is one error line."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import REPO, clean_env, launch, load_template, start_clean_accelerate

TEMPLATE = REPO / "templates" / "finetune_causal_lm.py"
sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_model import reverse_task  # noqa: E402

# Runs main() with export_model wrapped: before exporting, the (sharded) model's logits on the validation
# examples are saved, for comparison with the export loaded by from_pretrained in a plain process.
PROBE_WRAPPER = """
import sys, torch
sys.path.insert(0, {templates!r})
import finetune_causal_lm as ft

real_export = ft.export_model

def export_with_probe(accelerator, model, tokenizer, cfg, *where):
    train, val, kind = ft.load_examples(cfg, tokenizer)
    batch = ft.PadToLongest(tokenizer.pad_token_id)([(e.input_ids, e.labels) for e in val[:6]])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    model.train()
    if accelerator.is_main_process:
        torch.save({{"batch": batch, "logits": logits.float().cpu()}}, {out!r})
    return real_export(accelerator, model, tokenizer, cfg, *where)

ft.export_model = export_with_probe
ft.main()
"""

# Loads an export the way a user would, with transformers (and peft for an adapter) only.
PLAIN_LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
export, base, probe_file = sys.argv[1:4]
if base != "-":
    from peft import PeftModel
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), export)
else:
    model = AutoModelForCausalLM.from_pretrained(export)
probe = torch.load(probe_file)
with torch.no_grad():
    logits = model.eval()(input_ids=probe["batch"]["input_ids"], attention_mask=probe["batch"]["attention_mask"]).logits
torch.save(logits.float(), probe_file + ".plain")
"""


def ft():
    return load_template("finetune_causal_lm")


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


# --------------------------------------------------------------------------------------- unit tests
def learned(tokenizer, ids, labels) -> list[str]:
    """The learned tokens as text, one string per run of consecutive learned positions."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label != -100:
            assert label == token
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_prompt_completion_learns_only_the_completion_and_eos(tokenizer):
    ids, labels = ft().encode_completion(tokenizer, "reverse abc =", " cba")
    assert learned(tokenizer, ids, labels) == [" cba<|im_end|>"]
    assert tokenizer.decode(ids) == "reverse abc = cba<|im_end|>"


def test_chat_learns_only_assistant_messages_and_renders_like_the_template(tokenizer):
    messages = [{"role": "system", "content": "You reverse words."}, {"role": "user", "content": "abc"},
                {"role": "assistant", "content": "cba"}, {"role": "user", "content": "hg"},
                {"role": "assistant", "content": "gh"}]
    [(ids, labels)] = ft().encode_chat(tokenizer, messages)  # a template that only appends: one example
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    # each assistant turn with its end-of-turn; the role headers, system and user text stay context
    assert learned(tokenizer, ids, labels) == ["cba<|im_end|>\n", "gh<|im_end|>\n"]


def test_padding_changes_no_example_loss(tiny_model, tokenizer):
    from transformers import AutoModelForCausalLM

    module = ft()
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    pairs = [module.encode_completion(tokenizer, e["prompt"], e["completion"]) for e in reverse_task(3)]
    pairs[0] = module.encode_completion(tokenizer, "reverse abcdefgh abcdefgh =", " hgfedcba hgfedcba")
    batch = module.PadToLongest(tokenizer.pad_token_id)(pairs)
    longest = max(len(ids) for ids, _ in pairs)
    assert batch["input_ids"].shape == (3, longest)
    assert batch["attention_mask"].sum(1).tolist() == [len(ids) for ids, _ in pairs]
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()  # padding is never learned
    with torch.no_grad():
        losses, rows = module.target_losses(model, batch, per_token=True)
        padded = torch.zeros(len(pairs)).index_add_(0, rows, losses)
        for row, (ids, labels) in enumerate(pairs):
            alone = module.target_losses(model, {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels])})
            assert torch.allclose(padded[row], alone, rtol=1e-5), (row, padded[row], alone)


def test_validation_split_is_by_example_and_stable_when_data_grows(tmp_path, tokenizer):
    module = ft()
    cfg = module.Config(data_path=str(write_jsonl(tmp_path / "a.jsonl", reverse_task(200))), val_fraction=0.2)
    train, val, kind = module.load_examples(cfg, tokenizer)
    assert kind == "completion" and 20 <= len(val) <= 60 and not {e.key for e in train} & {e.key for e in val}
    cfg.data_path = str(write_jsonl(tmp_path / "b.jsonl", reverse_task(200) + reverse_task(100, seed=1)))
    _, val_grown, _ = module.load_examples(cfg, tokenizer)
    assert {e.key for e in val} <= {e.key for e in val_grown}  # no example changed sides


def test_plain_text_is_cut_into_windows_of_max_length_and_every_token_is_learned(tmp_path, tokenizer):
    module = ft()
    folder = tmp_path / "texts"
    folder.mkdir()
    for number in range(30):
        (folder / f"doc{number}.txt").write_text(f"document {number}: " + "the quick brown fox " * 12)
    train, val, kind = module.load_examples(module.Config(data_path=str(folder), max_length=16), tokenizer)
    assert kind == "text" and train and val
    for example in train + val:
        assert 2 <= len(example.input_ids) <= 16 and example.labels == example.input_ids
    document = [e for e in train + val if e.key.startswith("doc7.txt:")]
    ids = [token for e in sorted(document, key=lambda e: int(e.key.split(":")[1])) for token in e.input_ids]
    assert tokenizer.decode(ids) == "document 7: " + "the quick brown fox " * 12 + "<|im_end|>"  # nothing lost


# ------------------------------------------------------------------------------------- real launches
STEPS = ("--max_steps", "60", "--eval_every_steps", "30", "--batch_size", "16", "--warmup_steps", "5",
         "--log_every_steps", "10", "--tracker", "none", "--sample_tokens", "6")
RUNS = {  # name: (accelerate config, template options)
    "single-full": ("cpu.yaml", ("--learning_rate", "3e-3", *STEPS)),
    "single-lora-merged-chat": ("cpu.yaml", ("--learning_rate", "1e-2", "--lora_r", "8", "--lora_alpha", "16",
                                             "--merge_lora", "true", "--chat_data", *STEPS)),
    "ddp-full": ("cpu_ddp.yaml", ("--learning_rate", "3e-3", "--gradient_checkpointing", "true", *STEPS)),
    "fsdp-full": ("fsdp.yaml", ("--learning_rate", "3e-3", *STEPS)),
    "ddp-lora": ("cpu_ddp.yaml", ("--learning_rate", "1e-2", "--lora_r", "8", "--max_steps", "20",
                                  "--eval_every_steps", "10", "--batch_size", "8", "--tracker", "none",
                                  "--sample_tokens", "4")),
    "fsdp-lora": ("fsdp.yaml", ("--learning_rate", "1e-2", "--lora_r", "8", "--lora_target_modules",
                                "[q_proj, v_proj]", "--max_steps", "20", "--eval_every_steps", "10", "--batch_size",
                                "8", "--tracker", "none", "--sample_tokens", "4")),
}


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Every launch of this module, two at a time; each test reads the ones it is about."""
    root = tmp_path_factory.mktemp("finetune")
    data = {"completion": write_jsonl(root / "reverse.jsonl", reverse_task(600)),
            "chat": write_jsonl(root / "reverse_chat.jsonl", reverse_task(600, chat=True))}

    def run(name):
        config, args = RUNS[name]
        chat = "--chat_data" in args
        args = tuple(a for a in args if a != "--chat_data")
        out, probe = root / name, root / f"{name}.probe"
        wrapper = root / f"{name}_wrapper.py"
        wrapper.write_text(PROBE_WRAPPER.format(templates=str(REPO / "templates"), out=str(probe)))
        launcher = ("--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer") if config == "fsdp.yaml" else ()
        result = launch(config, wrapper, "--model", str(tiny_model), "--data_path", str(data["chat" if chat else
                        "completion"]), "--output_dir", str(out), *args, launcher_args=launcher, timeout=400,
                        num_processes=None if config == "cpu.yaml" else 2)
        return {"result": result, "out": out, "probe": probe}

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(RUNS, pool.map(run, RUNS)))


def finished(run) -> list[dict]:
    result = run["result"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [json.loads(line) for line in (run["out"] / "metrics.jsonl").read_text().splitlines()]


def test_a_higher_max_steps_extends_a_finished_run(runs, tiny_model, tmp_path):
    """A copy of the finished 60-step run, the same command with --max_steps 66: six more steps under the
    66-step schedule, then the evaluation and the export at step 66."""
    finished(runs["single-full"])
    out = tmp_path / "run"
    shutil.copytree(runs["single-full"]["out"], out)
    result = launch("cpu.yaml", REPO / "templates" / "finetune_causal_lm.py", "--model", str(tiny_model), "--data_path",
                    str(runs["single-full"]["out"].parent / "reverse.jsonl"), "--output_dir", str(out),
                    *RUNS["single-full"][1], "--max_steps", "66", timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "extending the run from --max_steps 60 to 66 (60 to 66 optimizer steps); the learning rate at step 60 " \
           "changes from 0.0003 to " in result.stdout
    assert [r["step"] for r in finished({"result": result, "out": out}) if "val/loss" in r][-1] == 66
    assert json.loads((out / "status.json").read_text())["step"] == 66


def test_every_target_token_weighs_the_same_across_micro_batches_and_ranks(tiny_model, tmp_path):
    """One optimizer step on the same 8 examples, whose completions are 1 to 12 words long: batch 8, accumulation
    4 x batch 2, 2 DDP ranks x batch 4 and 2 FSDP ranks x batch 2 x accumulation 2 log the same token-weighted
    train/loss and take the same step. A loss averaged per micro-batch (or per rank) would weigh a 2-token
    completion like a 40-token one."""
    import random

    from safetensors.torch import load_file

    rng = random.Random(1)
    records = [{"prompt": f"reverse {r['prompt'].split()[1]} =", "completion": r["completion"] * rng.randint(1, 12)}
               for r in reverse_task(80)]
    data = write_jsonl(tmp_path / "mixed.jsonl", records)
    arms = {"batch 8": ("cpu.yaml", None, ("--batch_size", "8")),
            "accumulation 4 x batch 2": ("cpu.yaml", None, ("--batch_size", "2", "--gradient_accumulation_steps", "4")),
            "2 DDP ranks x batch 4": ("cpu_ddp.yaml", 2, ("--batch_size", "4")),
            "2 FSDP ranks x batch 2 x accumulation 2": ("fsdp.yaml", 2, ("--batch_size", "2",
                                                                        "--gradient_accumulation_steps", "2"))}

    def run(arm):
        config, processes, args = arms[arm]
        out = tmp_path / arm.replace(" ", "_")
        launcher = ("--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer") if config == "fsdp.yaml" else ()
        result = launch(config, TEMPLATE, "--model", str(tiny_model), "--data_path", str(data), "--output_dir",
                        str(out), "--max_steps", "1", "--warmup_steps", "0", "--learning_rate", "1e-3",
                        "--grad_clip", "0", "--log_every_steps", "1", "--eval_every_steps", "0", "--sample_tokens",
                        "0", "--tracker", "none", *args, num_processes=processes, launcher_args=launcher,
                        timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        loss = [r["train/loss"] for r in finished({"result": result, "out": out}) if "train/loss" in r]
        return loss, load_file(out / "model" / "model.safetensors")

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(arms, pool.map(run, arms)))
    (reference_loss, reference), others = results["batch 8"], [a for a in arms if a != "batch 8"]
    for arm in others:
        loss, weights = results[arm]
        assert math.isclose(loss[0], reference_loss[0], rel_tol=1e-5), (arm, loss, reference_loss)
        difference = max((weights[name] - reference[name]).abs().max().item() for name in reference)
        assert difference < 1e-6, (arm, difference)  # AdamW's first step moves a weight by about the lr: 1e-3


@pytest.mark.parametrize("name", ["single-full", "single-lora-merged-chat", "ddp-full", "fsdp-full"])
def test_masked_validation_loss_falls_well_below_the_pretrained_models(runs, name):
    logged = [r for r in finished(runs[name]) if "val/loss" in r]
    assert [r["step"] for r in logged] == [0, 30, 60]  # before fine-tuning, then every --eval_every_steps
    start, end = logged[0]["val/loss"], logged[-1]["val/loss"]
    assert end < 0.65 * start, (start, end)
    assert math.isclose(logged[-1]["val/perplexity"], math.exp(end), rel_tol=1e-6)
    assert (runs[name]["out"] / "status.json").is_file() and "sample:\n" in runs[name]["result"].stdout


def test_every_validation_token_counts_once_on_any_number_of_ranks(runs):
    tokens = {name: [r["val/tokens"] for r in finished(runs[name]) if "val/tokens" in r]
              for name in ("single-full", "ddp-full", "fsdp-full")}
    assert tokens["ddp-full"] == tokens["single-full"] == tokens["fsdp-full"], tokens
    # and the untrained model scores the same: rank 0's weights reached every FSDP shard (rotary buffers too)
    at_start = {name: finished(runs[name])[0]["val/loss"] for name in ("single-full", "ddp-full", "fsdp-full")}
    assert math.isclose(at_start["fsdp-full"], at_start["single-full"], rel_tol=1e-6), at_start
    assert math.isclose(at_start["ddp-full"], at_start["single-full"], rel_tol=1e-6), at_start


@pytest.mark.parametrize("name", list(RUNS))
def test_export_loads_with_from_pretrained_in_a_plain_process_with_the_same_logits(runs, tiny_model, name):
    finished(runs[name])
    export = runs[name]["out"] / "model"
    lora_adapter = "--lora_r" in RUNS[name][1] and "--merge_lora" not in RUNS[name][1]
    assert (export / ("adapter_model.safetensors" if lora_adapter else "model.safetensors")).is_file()
    assert (export / "tokenizer.json").is_file()
    if not lora_adapter:
        assert json.loads((export / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    plain = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(export), str(tiny_model) if lora_adapter else "-",
                            str(runs[name]["probe"])], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr[-3000:]
    trained = torch.load(runs[name]["probe"])
    mask = trained["batch"]["attention_mask"].bool()
    difference = (torch.load(f"{runs[name]['probe']}.plain")[mask] - trained["logits"][mask]).abs().max().item()
    assert difference < 1e-4, difference


@pytest.mark.parametrize("name", ["single-full", "ddp-full", "fsdp-full", "single-lora-merged-chat"])
def test_a_full_export_is_its_checkpoints_weights_file_linked_not_written_again(runs, name):
    """One process or DDP, full fine-tuning: the export's weights are the final checkpoint's file, hard-linked (the
    same inode: written once), and it loads in a plain process with the trained logits (the test above). FSDP's
    checkpoint is sharded and a merged LoRA export is another model: those are written."""
    finished(runs[name])
    exported = runs[name]["out"] / "model" / "model.safetensors"
    checkpoint = runs[name]["out"] / "checkpoints" / "step_00000060" / "model.safetensors"
    if name in ("single-full", "ddp-full"):
        assert exported.samefile(checkpoint)
    else:
        assert exported.is_file() and exported.stat().st_nlink == 1  # no other name: written for the export


@pytest.mark.parametrize("name", list(RUNS))
def test_every_export_keeps_the_base_models_generation_config_with_the_cache_on(runs, tiny_model, name):
    """Full, merged LoRA, LoRA adapter, DDP and FSDP exports: the base's sampling defaults and extra stop ids
    (the tiny model has both), and the KV cache on, whatever training did (gradient checkpointing turns it off)."""
    from transformers import GenerationConfig

    finished(runs[name])
    base = GenerationConfig.from_pretrained(tiny_model).to_diff_dict()
    assert base["do_sample"] is True and len(base["eos_token_id"]) == 2
    exported = GenerationConfig.from_pretrained(runs[name]["out"] / "model").to_diff_dict()
    assert exported == base | {"use_cache": True}, (exported, base)


@pytest.mark.parametrize("name", ["single-lora-merged-chat", "ddp-lora"])
def test_lora_checkpoints_hold_the_adapter_and_its_optimizer_state_only(runs, name):
    logged = [r for r in finished(runs[name]) if "val/loss" in r]
    assert logged[-1]["val/loss"] < logged[0]["val/loss"]
    from safetensors.torch import load_file

    checkpoint = sorted((runs[name]["out"] / "checkpoints").glob("step_*"))[-1]
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert weights and all("lora_" in key for key in weights), sorted(weights)[:5]
    optimizer = torch.load(checkpoint / "optimizer.bin", weights_only=True)
    assert sum(len(group["params"]) for group in optimizer["param_groups"]) == len(weights)


def test_fsdp_lora_trains_and_exports_an_adapter_of_the_named_modules(runs):
    logged = [r for r in finished(runs["fsdp-lora"]) if "val/loss" in r]
    assert logged[-1]["val/loss"] < logged[0]["val/loss"]
    adapter = json.loads((runs["fsdp-lora"]["out"] / "model" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"] and adapter["r"] == 8


def test_a_lora_run_as_the_readme_types_it_is_quiet_and_its_adapter_loads_from_another_folder(tiny_model, tmp_path):
    """`--model tiny` typed relative to the working folder: the adapter records the base model's absolute path.
    Activation checkpointing through transformers' current call, and peft's question about it, warn nothing;
    `--num_cpu_threads_per_process` keeps accelerate's note about the CPU threads away (README, "Errors and exit
    codes")."""
    import shutil

    work = tmp_path / "work"
    shutil.copytree(tiny_model, work / "tiny")
    data = write_jsonl(work / "reverse.jsonl", reverse_task(64))
    env = {k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}  # as in a user's shell
    result = launch("cpu.yaml", REPO / "templates" / "finetune_causal_lm.py", "--model", "tiny", "--data_path",
                    data.name, "--lora_r", "4", "--gradient_checkpointing", "true", "--max_steps", "2",
                    "--eval_every_steps", "2", "--batch_size", "8", "--tracker", "none", "--sample_tokens", "0",
                    launcher_args=("-q", "--num_cpu_threads_per_process", "1"), cwd=work, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "Warning" not in result.stderr and "num_cpu_threads_per_process" not in result.stderr, result.stderr
    # In a log file transformers' bars (loading weights, writing shards) would be fragments glued to the next line.
    bars = [line for line in result.stderr.splitlines() if ("it/s]" in line or "s/it]" in line)
            and not line.startswith("train: ")]
    assert bars == [], result.stderr
    export = work / "runs" / "finetune_causal_lm" / "model"
    adapter = json.loads((export / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((work / "tiny").resolve())
    load = ("import sys; from peft import AutoPeftModelForCausalLM; "
            "print(type(AutoPeftModelForCausalLM.from_pretrained(sys.argv[1])).__name__)")
    loaded = subprocess.run([sys.executable, "-c", load, str(export)], cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "PeftModelForCausalLM", loaded.stderr[-3000:]


# ---------------------------------------------------------------------------------------- bad input
BAD = {  # name: (options, data lines or None for the default task, the expected part of the one error line)
    "model-missing": (("--model", "{tmp}/no_such_model"), None, "--model {tmp}/no_such_model: cannot load it"),
    "not-a-causal-lm": (("--model", "{bert}"), None, "a 'distilbert' model is not a causal language model"),
    "line-not-json": ((), ['{"prompt": "a", "completion": " b"}', "{oops"], "data.jsonl line 2: not JSON"),
    "fields-missing": ((), ['{"question": "a", "answer": "b"}'],
                       "data.jsonl line 1: needs 'prompt' and 'completion', 'messages' or 'text' (TRL's columns); "
                       "it has 'question', 'answer'"),
    "empty-completion": ((), ['{"prompt": "a", "completion": "  "}'], "line 1: empty completion: nothing to learn"),
    "too-long": (("--max_length", "8"), None, "examples are longer than --max_length 8 (e.g. line 1 ("),
    "chat-without-template": (("--model", "{no_template}"), ['{"messages": [{"role": "user", "content": "a"}, '
                                                              '{"role": "assistant", "content": "b"}]}'],
                              "chat messages, but the tokenizer of --model has no chat template"),
    "lora-target-missing": (("--lora_r", "4", "--lora_target_modules", "[c_attn]"), None,
                            "--lora_target_modules: the model has no module named c_attn (its linear layers: "),
}


@pytest.fixture(scope="module")
def bad_input_models(tiny_model, tmp_path_factory):
    """A DistilBERT (an encoder, not a causal LM) and the tiny model without its chat template, written offline."""
    import shutil

    from transformers import DistilBertConfig, DistilBertModel

    root = tmp_path_factory.mktemp("bad_models")
    DistilBertModel(DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64,
                                     vocab_size=100)).save_pretrained(root / "bert")
    shutil.copytree(tiny_model, root / "no_template")
    (root / "no_template" / "chat_template.jinja").unlink()
    settings = json.loads((root / "no_template" / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (root / "no_template" / "tokenizer_config.json").write_text(json.dumps(settings))
    return root


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_error_line_exit_2_and_nothing_written(case, tmp_path, tiny_model, bad_input_models,
                                                                 fresh_accelerate, capsys):
    options, lines, expected = BAD[case]
    fill = {"tmp": str(tmp_path), "bert": str(bad_input_models / "bert"),
            "no_template": str(bad_input_models / "no_template")}
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n" if lines else "".join(json.dumps(r) + "\n" for r in reverse_task(50)))
    out = tmp_path / "out"
    argv = ["--model", str(tiny_model), "--data_path", str(data), "--output_dir", str(out), "--tracker", "none",
            *[o.format(**fill) for o in options]]
    with pytest.raises(SystemExit) as stop:
        ft().main(argv)
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected.format(**fill) in errors[0], errors
    assert not out.exists()  # refused before anything was written


def test_bad_input_run_as_a_program_prints_only_the_error_line(tmp_path, tiny_model):
    """The real program, not main() in-process: stderr is the one line, no traceback, exit 2."""
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "a", "completion": ""}])
    done = subprocess.run([sys.executable, str(TEMPLATE), "--model", str(tiny_model), "--data_path", str(data),
                           "--output_dir", str(tmp_path / "out"), "--tracker", "none"],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [f"error: {data} line 1: empty completion: nothing to learn"]
    assert not (tmp_path / "out").exists()


def test_early_stopping_ends_the_run_and_exports_the_best_weights_and_a_rerun_trains_no_further(
        tmp_path, tiny_model, monkeypatch, capsys):
    """A scripted validation loss (best at step 4, worse at 6 and 8) with --early_stopping_patience 2 and
    evaluations every 2 steps: the run ends at step 8, finished, and exports the best checkpoint's weights. The
    same command again resumes at step 8 and stops there (the count comes from the state), exporting the same."""
    from safetensors.torch import load_file

    module = ft()
    losses = iter([9.0, 5.0, 4.0, 4.5, 4.6, 4.6])  # before training, then steps 2, 4, 6, 8; the rerun: step 8

    def scripted(model, loader, accelerator):
        loss = next(losses)
        return {"val/loss": loss, "val/perplexity": math.exp(loss), "val/tokens": 1}

    monkeypatch.setattr(module, "evaluate", scripted)
    out = tmp_path / "run"
    argv = ["--model", str(tiny_model), "--data_path", str(write_jsonl(tmp_path / "d.jsonl", reverse_task(120))),
            "--output_dir", str(out), "--tracker", "none", "--max_steps", "20", "--eval_every_steps", "2",
            "--early_stopping_patience", "2", "--batch_size", "4", "--learning_rate", "1e-2", "--sample_tokens", "0"]
    for attempt in range(2):
        start_clean_accelerate(monkeypatch)
        module.main(argv)
        printed = capsys.readouterr().out
        assert "stopped at step 8: early stopping: no better val/loss in 2 evaluations after step 4" in printed
        assert "exported the weights of step 4 (best val/loss 4.0000)" in printed
        status = json.loads((out / "status.json").read_text())
        assert status["state"] == "finished" and status["step"] == 8 and "early stopping" in status["reason"]
        best = load_file(str(out / "checkpoints" / "best_step_00000004" / "model.safetensors"))
        exported = load_file(str(out / "model" / "model.safetensors"))
        assert best.keys() == exported.keys() and all(torch.equal(best[k], exported[k]) for k in best)
        last = load_file(str(out / "checkpoints" / "step_00000008" / "model.safetensors"))
        assert not all(torch.equal(last[k], exported[k]) for k in last)  # the last step's weights differ
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step_00000008"  # nothing trained after


def test_early_stopping_without_evaluations_is_refused(tmp_path, tiny_model, capsys, fresh_accelerate):
    with pytest.raises(SystemExit) as stop:
        ft().main(["--model", str(tiny_model), "--data_path", "x.jsonl", "--output_dir", str(tmp_path / "out"),
                   "--early_stopping_patience", "3", "--eval_every_steps", "0"])
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert errors == ["error: --early_stopping_patience counts evaluations: it needs --eval_every_steps above 0"]
    assert not (tmp_path / "out").exists()


class Oracle(torch.nn.Module):
    """A stand-in model whose greedy next token continues `text` (the expected answer, then its EOS), called as
    `generate` calls a model: left-padded prompts, then one token a row over its cache (here: the ids so far)."""

    def __init__(self, sequences: list[list[int]], vocab: int):
        super().__init__()
        self.sequences, self.vocab = sequences, vocab

    def forward(self, input_ids, attention_mask, cache=None, **ignored):
        rows = [ids + new for ids, new in zip(cache or [[] for _ in input_ids], input_ids.tolist())]
        logits = torch.zeros(len(rows), 1, self.vocab)
        for i, (row, keep) in enumerate(zip(rows, attention_mask.tolist())):
            ids = [token for token, kept in zip(row, keep) if kept]
            sequence = next(s for s in self.sequences if s[:len(ids)] == ids)
            logits[i, -1, sequence[len(ids)] if len(ids) < len(sequence) else 0] = 1.0
        return Output(logits=logits, cache=rows)


class Output(dict):
    """A model output as transformers returns one: a dict whose keys are attributes too."""

    def __getattr__(self, name):
        return self[name]


def test_probe_answers_are_exact_only_when_the_whole_answer_and_its_end_come_out(tokenizer):
    module = ft()
    examples = [module.Example(*module.encode_completion(tokenizer, e["prompt"], e["completion"]), key=str(i))
                for i, e in enumerate(reverse_task(3))]
    probes = module.probe_prompts(examples, 2, tokenizer.eos_token_id)
    assert [tokenizer.decode(prompt) for prompt, _ in probes] == [e["prompt"] for e in reverse_task(2)]
    assert [tokenizer.decode(answer) for _, answer in probes] == [e["completion"] for e in reverse_task(2)]
    perfect = Oracle([e.input_ids for e in examples], len(tokenizer))
    rows, exact = module.answer_probes(perfect, probes, tokenizer, "cpu")
    assert exact == 1.0 and [r["output"] for r in rows] == [r["expected"] for r in rows]
    rambling = Oracle([e.input_ids[:-1] + e.input_ids[-2:-1] * 3 for e in examples], len(tokenizer))  # no EOS
    assert module.answer_probes(rambling, probes, tokenizer, "cpu")[1] == 0.0


def greedy_alone(model, prompt: list[int], new_tokens: int, eos_id: int) -> list[int]:
    """How the template answered before it batched and cached: one prompt alone, the whole sequence run again for
    each new token (no cache), the last position's argmax appended."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(input_ids=ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    answer = ids[0, len(prompt):].tolist()
    return answer[:answer.index(eos_id)] if eos_id in answer else answer


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_answers_in_one_batch_with_the_cache_are_each_prompts_greedy_answer_alone(tiny_model, tokenizer, lora):
    """`generate` left-pads prompts of other lengths into one batch and decodes over the KV cache: every answer is
    token for token the one the prompt gets alone without a cache, on a model as the template trains it (cache off
    in its config, in train mode: LoRA's dropout must be off while it answers), and train mode comes back."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.config.use_cache = False
    if lora:  # a random adapter (B not zero), with heavy dropout that only train mode applies
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.5,
                                                 init_lora_weights=False))
    records = reverse_task(5) + reverse_task(2, seed=1, chat=True)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in records[:5]] + [
        tokenizer(tokenizer.apply_chat_template(r["messages"][:-1], tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"] for r in records[5:]] + [[tokenizer.eos_token_id]]
    counts = [12, 3, 7, 1, 12, 9, 12, 5]
    assert len({len(p) for p in prompts}) >= 4  # lengths differ: the batch is padded
    model.eval()
    alone = [greedy_alone(model, prompt, count, tokenizer.eos_token_id) for prompt, count in zip(prompts, counts)]
    model.train()
    batched = ft().generate(model, prompts, counts, tokenizer.eos_token_id, tokenizer.pad_token_id, "cpu")
    assert model.training
    assert batched == alone and len({tuple(a) for a in alone}) > 1 and max(map(len, alone)) == 12, (batched, alone)


def test_each_evaluation_logs_its_answers_and_their_exact_match(runs):
    records = finished(runs["single-full"])
    assert [r["step"] for r in records if "val/exact_match" in r] == [30, 60]
    samples = [json.loads(line) for line in (runs["single-full"]["out"] / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [30] * 4 + [60] * 4
    assert all(s["prompt"].startswith("reverse ") and s["expected"].strip() for s in samples)
    chat = finished(runs["single-lora-merged-chat"])  # answers logged; exact match is for prompt/completion data
    assert not any("val/exact_match" in r for r in chat)
    assert (runs["single-lora-merged-chat"]["out"] / "samples.jsonl").read_text().count('"step": 60') == 4
