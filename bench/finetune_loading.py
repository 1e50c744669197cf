"""Host memory per rank while 2 FSDP2 ranks load a pretrained model: one copy per machine vs every rank a copy.

The script writes a randomly initialised Llama-architecture model to disk (fp32 safetensors, ~322M
parameters by default), then launches 2 gloo ranks with accelerate_configs/fsdp.yaml for each way:

  one copy   the template's own `load_model` + `accelerator.prepare`: rank 0 reads the weights, the other
             rank builds the model on the meta device, and accelerate's cpu_ram_efficient_loading
             broadcasts rank 0's weights into each rank's shard
  naive      every rank `from_pretrained`, then the same `prepare` (which shards what each rank loaded)

Each rank samples its private memory (RssAnon in /proc/self/status) every 5 ms from before the model
is loaded until it is sharded, and reports the peak increase over the start, and its peak RSS
(ru_maxrss, which also counts mapped file pages, shared between ranks). Figures are multiples of the
model's bytes (the file). Weights load in fp32 (the template's choice on a CPU: no mixed precision).

    python bench/finetune_loading.py                  # ~3 minutes, ~4 GB free memory needed
    python bench/finetune_loading.py --quick          # seconds: a tiny model, checks the script
    python bench/finetune_loading.py --write-results  # also update bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

TARGET = 0.6  # ranks other than 0, with 2 ranks: at most this many model copies
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def private_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(way: str, model_dir: str, out: str, dtype: str) -> None:
    """One rank: load the model one way, shard it, report the memory it took."""
    import torch

    from common.accelerator import build_accelerator

    module = harness.load_template("finetune_causal_lm")
    accelerator = build_accelerator(seed=0, timeout_s=1800)
    if dtype == "bf16":  # what the template does under bf16 mixed precision (a GPU that has it): load in bf16
        accelerator.state._mixed_precision = "bf16"
    cfg = module.Config(model=model_dir, data_path="-")
    _, config = module.load_tokenizer_and_config(model_dir)
    # What loading imports lazily is not the model's memory: import it before measuring.
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    accelerator.wait_for_everyone()
    start, peak, done = private_bytes(), [private_bytes()], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], private_bytes())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    began = time.perf_counter()
    if way == "one_copy":
        model = module.load_model(cfg, accelerator, config)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, DTYPES[dtype]))
    model = accelerator.prepare(model)
    seconds = time.perf_counter() - began
    done.set()
    sampler.join()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    Path(f"{out}.rank{accelerator.process_index}.json").write_text(json.dumps({
        "private_increase": peak[0] - start, "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "seconds": seconds, "local_parameters": local}))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def write_model(folder: Path, hidden: int, layers: int, intermediate: int, vocab: int) -> int:
    """A random untied Llama with a tokenizer, written with save_pretrained; returns the weights' bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec_path = harness.REPO / "scripts" / "make_tiny_model.py"
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_model", spec_path)
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tiny.train_tokenizer(384).save_pretrained(folder)  # the template loads a tokenizer with the model
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def launch(way: str, model_dir: Path, out: Path, threads: int, dtype: str) -> list[dict]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(harness.CONFIGS / "fsdp.yaml"), "--num_processes", "2", "--main_process_port",
               str(harness.free_port()), "--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer",
               __file__, "--worker", way, "--model-dir", str(model_dir), "--out", str(out), "--dtype", dtype]
    done = subprocess.run(command, cwd=harness.REPO, env=harness.clean_env(threads), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{way}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model: checks the script, measures nothing")
    parser.add_argument("--write-results", action="store_true", help="replace this script's section of RESULTS.md")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--dtype", choices=sorted(DTYPES), nargs="+", default=["fp32", "bf16"],
                        help="weights as loaded: fp32 (the template on a CPU) and/or bf16 (under bf16 mixed precision)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model_dir, args.out, args.dtype[0])

    shape = dict(hidden=128, layers=2, intermediate=256, vocab=1024) if args.quick else \
        dict(hidden=1024, layers=20, intermediate=2816, vocab=32000)
    with tempfile.TemporaryDirectory(prefix="finetune_loading_") as tmp:
        model_dir = Path(tmp) / "model"
        model_bytes = write_model(model_dir, **shape)
        print(f"model: Llama-architecture {shape}, {model_bytes / 2**20:,.0f} MiB of fp32 weights")
        results = {(dtype, way): launch(way, model_dir, Path(tmp) / f"{dtype}-{way}", args.threads, dtype)
                   for dtype in args.dtype for way in ("one_copy", "naive")}
    rows = []
    for (dtype, way), ranks in results.items():
        for rank, report in enumerate(ranks):
            rows.append([dtype, way.replace("_", " "), rank, f"{report['private_increase'] / model_bytes:.2f}x",
                         f"{report['private_increase'] / 2**20:,.0f}", f"{report['max_rss'] / 2**20:,.0f}",
                         f"{report['seconds']:.1f}"])
    body = harness.table(["loaded as", "way", "rank", "private memory added while loading (x model file)", "MiB",
                          "peak RSS MiB", "load + shard s"], rows)
    rank1 = {key: ranks[1]["private_increase"] / model_bytes for key, ranks in results.items()}
    verdict = "; ".join(f"{dtype}: rank 1 one copy {rank1[dtype, 'one_copy']:.2f}x, naive {rank1[dtype, 'naive']:.2f}x"
                        for dtype in args.dtype) + f" (target for rank 1, one copy: <= {TARGET}x)"
    print(body + "\n\n" + verdict)
    if args.write_results and not args.quick:
        harness.write_results("finetune_loading", "Fine-tuning: host memory per rank while 2 FSDP ranks load a model",
                              f"Model: random Llama-architecture {shape}, {model_bytes / 2**20:,.0f} MiB (fp32).\n\n"
                              f"{body}\n\n{verdict}", harness.machine())


if __name__ == "__main__":
    main()
