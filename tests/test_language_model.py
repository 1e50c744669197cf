"""templates/language_model.py under real `accelerate launch`: one process, 2 DDP ranks and 2 FSDP2
ranks on CPU train a tiny model; an interrupted and resumed run ends bit-identical to an
uninterrupted one; an FSDP export reproduces the sharded model's logits; text and token files give
the same batches; bad input ends in one `error:` line and exit code 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO, clean_env, copy_into_monorepo, copy_template_alone, launch, load_template
from helpers import read_metrics, tiny_text

TEMPLATE = REPO / "templates" / "language_model.py"
STEPS = 14
# 380 lines -> 38 batches of 8 windows: 19 micro-batches per epoch on each of 2 ranks, so with
# accumulation 2 an epoch is 10 optimizer steps, the last of a single micro-batch.
TINY = ["--tracker", "none", "--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32",
        "--batch_size", "8", "--learning_rate", "1e-2", "--warmup_steps", "2", "--log_every_steps", "1",
        "--eval_every_steps", "5", "--eval_batches", "4", "--sample_tokens", "8", "--max_steps", str(STEPS)]
# What exact resume has to survive: dropout, loader workers, gradient accumulation, an epoch boundary.
HARD = ["--dropout", "0.1", "--num_workers", "1", "--gradient_accumulation_steps", "2"]

# Runs main() with export_weights wrapped: before exporting, the (sharded) model's logits on a fixed
# probe batch are saved, for comparison with the exported weights in a plain single-process model,
# and whether each transformer block is its own FSDP unit (fsdp.yaml names the class `Block`).
PROBE_WRAPPER = """
import sys, torch
from torch.distributed.fsdp import FSDPModule
sys.path.insert(0, {templates!r})
import language_model as lm

real_export = lm.export_weights

def export_with_probe(accelerator, model, path, **kwargs):
    probe = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(1)).to(accelerator.device)
    model.eval()
    with torch.no_grad():
        logits = model(probe)
    model.train()
    if accelerator.is_main_process:
        wrapped = [isinstance(block, FSDPModule) for block in model.blocks]
        torch.save({{"probe": probe.cpu(), "logits": logits.cpu(), "blocks_wrapped": wrapped}}, {out!r})
    return real_export(accelerator, model, path, **kwargs)

lm.export_weights = export_with_probe
lm.main()
"""


def template():
    return load_template("language_model")


def run(config: str, out: Path, corpus: Path, *extra: str, script: Path = TEMPLATE) -> subprocess.CompletedProcess:
    result = launch(config, script, "--data_path", str(corpus), "--output_dir", str(out), *TINY, *extra,
                    num_processes=2 if config != "cpu.yaml" else None)
    assert result.returncode == 0, f"{config} run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def metrics(out: Path, key: str) -> dict[int, float]:
    """One metric of a run, by step."""
    return {r["step"]: r[key] for r in read_metrics(out) if key in r}


def assert_loss_falls(out: Path) -> None:
    losses = metrics(out, "train/loss")
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    first, last = np.mean([losses[s] for s in (1, 2)]), np.mean([losses[s] for s in (STEPS - 1, STEPS)])
    assert last < first - 1.0, f"training loss did not fall: {first:.3f} -> {last:.3f}"
    assert metrics(out, "val/loss")[STEPS] < metrics(out, "val/loss")[5]


def assert_same_weights(a: Path, b: Path) -> None:
    first, second = load_file(str(a)), load_file(str(b))
    assert sorted(first) == sorted(second)
    different = [k for k in first if not torch.equal(first[k], second[k])]
    assert not different, f"parameters differ after resume: {different}"


def interrupted(config: str, out: Path, corpus: Path, stop_after: int) -> None:
    first = run(config, out, corpus, *HARD, "--stop_after_steps", str(stop_after))
    assert f"stopped at step {stop_after}" in first.stdout
    assert not (out / "model.safetensors").exists()
    second = run(config, out, corpus, *HARD, "--resume", "auto")
    assert f"resumed from {out / 'checkpoints' / f'step_{stop_after:08d}'} at step {stop_after}" in second.stdout


# ----------------------------------------------------------------------------------- one process
def test_one_process_trains_exports_and_samples(tmp_path, corpus):
    result = run("cpu.yaml", tmp_path / "run", corpus)
    assert "1 process on cpu, mixed precision" in result.stdout
    assert_loss_falls(tmp_path / "run")
    assert (tmp_path / "run" / "model.safetensors").is_file()
    bpb = metrics(tmp_path / "run", "val/bpb")[STEPS]
    assert bpb == pytest.approx(metrics(tmp_path / "run", "val/loss")[STEPS] / math.log(2))
    assert f"validation: {bpb:.3f} bits per byte; unigram entropy of the same bytes" in result.stdout
    assert "sample:\ndef " in result.stdout
    assert metrics(tmp_path / "run", "tokens_per_s") and metrics(tmp_path / "run", "peak_memory_gb")
    assert not metrics(tmp_path / "run", "mfu")  # no GPU, no peak to compare with: no MFU rather than a made-up one


def test_a_higher_max_steps_extends_a_finished_run(tmp_path, corpus):
    """The finished 14-step run, the same command with --max_steps 20: it trains steps 15 to 20 under the
    20-step schedule (the cosine had ended at 0.1 of 1e-2), validates and exports at step 20."""
    out = tmp_path / "run"
    run("cpu.yaml", out, corpus)
    result = run("cpu.yaml", out, corpus, "--max_steps", "20")
    assert ("extending the run from --max_steps 14 to 20 (14 to 20 optimizer steps); the learning rate at step 14 "
            "changes from 0.001 to 0.00325 (the warmup and cosine of the new length from here on)") in result.stdout
    assert sorted(metrics(out, "train/loss")) == list(range(1, 21)) and sorted(metrics(out, "val/loss"))[-1] == 20
    assert json.loads((out / "status.json").read_text())["step"] == 20 and (out / "model.safetensors").is_file()


def test_template_and_common_alone_train_in_an_empty_folder(tmp_path):
    """Copied as the README says (this file and common/), on its built-in corpus, with no repo around it."""
    app, env = copy_template_alone("language_model", tmp_path)
    launched = launch("cpu.yaml", app / "language_model.py", *TINY, cwd=app, env=env)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "bits per byte; unigram entropy of the same bytes" in launched.stdout
    assert (app / "runs" / "language_model" / "model.safetensors").is_file()  # the default output_dir
    assert sorted(p.name for p in app.iterdir()) == ["common", "language_model.py", "runs"]


@pytest.mark.parametrize("shadow", ["module", "package"])
def test_a_copy_inside_a_monorepo_imports_its_own_common_not_the_one_above_it(tmp_path, corpus, shadow):
    proj, env = copy_into_monorepo("language_model", tmp_path, shadow)
    tiny = ("--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--max_steps", "2",
            "--eval_batches", "1", "--sample_tokens", "0", "--tracker", "none", "--data_path", str(corpus))
    launched = launch("cpu.yaml", proj / "train.py", *tiny, "--output_dir", str(proj / "runs" / "x"), cwd=proj.parent,
                      env=env)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "bits per byte" in launched.stdout and (proj / "runs" / "x" / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------- DDP
@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, corpus) -> tuple[Path, Path, str]:
    root = tmp_path_factory.mktemp("ddp")
    whole = run("cpu_ddp.yaml", root / "whole", corpus, *HARD)
    interrupted("cpu_ddp.yaml", root / "resumed", corpus, stop_after=6)  # resumes in epoch 0, then crosses into epoch 1
    return root / "whole", root / "resumed", whole.stdout


def test_ddp_trains_with_the_planned_schedule(ddp_runs):
    whole, _, stdout = ddp_runs
    assert "2 processes on cpu (MULTI_CPU)" in stdout and "19 micro-batches per epoch" in stdout
    assert_loss_falls(whole)
    # One scheduler step per optimizer step, also with 2 processes (accelerate's default takes 2).
    from common.optim import warmup_cosine

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
    scheduler = warmup_cosine(optimizer, 2, STEPS)
    expected = {}
    for step in range(1, STEPS + 1):
        optimizer.step()
        scheduler.step()
        expected[step] = scheduler.get_last_lr()[0]
    assert metrics(whole, "lr") == pytest.approx(expected)


def test_ddp_resume_is_bit_identical(ddp_runs):
    whole, resumed, _ = ddp_runs
    assert_same_weights(whole / "model.safetensors", resumed / "model.safetensors")


# ------------------------------------------------------------------------------------------ FSDP
@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, corpus) -> tuple[Path, Path, str, Path]:
    root = tmp_path_factory.mktemp("fsdp")
    wrapper, probe = root / "probe_export.py", root / "probe.pt"
    wrapper.write_text(PROBE_WRAPPER.format(templates=str(REPO / "templates"), out=str(probe)))
    whole = run("fsdp.yaml", root / "whole", corpus, *HARD, script=wrapper)
    interrupted("fsdp.yaml", root / "resumed", corpus, stop_after=11)  # resumes inside epoch 1
    return root / "whole", root / "resumed", whole.stdout, probe


def test_fsdp_trains_sharded_one_unit_per_block(fsdp_runs):
    whole, _, stdout, probe_file = fsdp_runs
    assert "2 processes on cpu (FSDP)" in stdout
    assert_loss_falls(whole)
    assert torch.load(probe_file)["blocks_wrapped"] == [True, True]
    # The checkpoint holds sharded model state (one distributed-checkpoint folder), not a full copy.
    assert (whole / "checkpoints" / f"step_{STEPS:08d}" / "pytorch_model_fsdp_0").is_dir()


def test_fsdp_resume_is_bit_identical(fsdp_runs):
    whole, resumed, _, _ = fsdp_runs
    assert_same_weights(whole / "model.safetensors", resumed / "model.safetensors")


def test_fsdp_export_loads_into_a_plain_model_with_the_same_logits(fsdp_runs):
    from common.export import export_info, load_exported

    whole, _, _, probe_file = fsdp_runs
    lm = template()
    info = export_info(whole / "model.safetensors")  # the export alone says how to rebuild its model
    assert info == json.loads((whole / "run.json").read_text())["model"] and info["byte_level"] is True
    assert info["model"] == {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32,
                             "dropout": 0.1}
    model = lm.GPT(**info["model"])
    load_exported(model, whole / "model.safetensors")
    probe = torch.load(probe_file)
    model.eval()
    with torch.no_grad():
        logits = model(probe["probe"])
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ data
def config(lm, *argv: str):
    return lm.parse_config(lm.Config, ["--block_size", "16", "--val_fraction", "0.25", *argv])


def test_token_file_and_text_file_give_the_same_batches(tmp_path):
    from common.data import build_loader

    lm = template()
    data = tiny_text(60).encode()
    (tmp_path / "text.txt").write_bytes(data)
    np.array(list(data), dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    text = lm.load_corpus(config(lm, "--data_path", str(tmp_path / "text.txt")))
    tokens = lm.load_corpus(config(lm, "--data_path", str(tmp_path / "tokens.bin")))
    assert text.byte_level and not tokens.byte_level
    assert tokens.vocab_size == 128  # largest byte of this ASCII text + 1, rounded up to 64
    for a, b in ((text.train, tokens.train), (text.val, tokens.val)):
        assert len(a) == len(b) > 0
        loaders = [build_loader(d, batch_size=4, train=True, seed=3, device=torch.device("cpu")) for d in (a, b)]
        for (x1, y1), (x2, y2) in zip(*loaders, strict=True):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
            assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
    # nanoGPT's layout, a folder with train.bin and val.bin, reads each file as its split.
    folder = tmp_path / "prepared"
    folder.mkdir()
    cut = len(data) // 2
    np.array(list(data[:cut]), dtype=np.uint16).tofile(folder / "train.bin")
    np.array(list(data[cut:]), dtype=np.uint16).tofile(folder / "val.bin")
    prepared = lm.load_corpus(config(lm, "--data_path", str(folder)))
    assert len(prepared.train) == (cut - 1) // 16
    assert torch.equal(prepared.val[1][0], torch.tensor(list(data[cut + 16 : cut + 32])))


def test_text_folder_splits_by_file(tmp_path):
    lm = template()
    for i in range(40):
        (tmp_path / f"file{i:02d}.txt").write_bytes(bytes([65 + i]) * 40)  # one distinct byte per file
    corpus = lm.load_corpus(config(lm, "--data_path", str(tmp_path)))
    train, val = set(corpus.train.array().tolist()), set(corpus.val.array().tolist())
    assert train and val and not train & val


def test_init_from_loads_an_export_also_for_shorter_sequences(tmp_path):
    lm = template()
    export = tiny_export(tmp_path / "model.safetensors", block_size=32)
    model = lm.build_model(config(lm, "--init_from", str(export), "--n_layer", "1", "--n_head", "2", "--n_embd", "32"),
                           vocab_size=256)
    saved = load_file(str(export))
    assert model.block_size == 32  # --block_size 16 trains on the export's first 16 positions
    assert all(torch.equal(p, saved[k]) for k, p in model.state_dict().items())
    assert model.lm_head.weight is model.wte.weight
    assert model(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 256)


# ------------------------------------------------------------------------------------- bad input
def tiny_export(path: Path, n_embd: int = 32, block_size: int = 32) -> Path:
    lm = template()
    model = lm.GPT(vocab_size=256, block_size=block_size, n_layer=1, n_head=2, n_embd=n_embd)
    save_file({k: v.clone() for k, v in model.state_dict().items()}, str(path))
    return path


def bad_input(case: str, folder: Path, corpus: Path) -> tuple[list[str], str]:
    """(arguments, part of the expected message) for each kind of bad input."""
    if case == "empty corpus":
        (folder / "empty.txt").write_bytes(b"")
        return ["--data_path", str(folder / "empty.txt")], "empty corpus"
    if case == "odd-sized token file":
        (folder / "odd.bin").write_bytes(b"abc")
        return ["--data_path", str(folder / "odd.bin")], "has 3 bytes, not a multiple of 2"
    if case == "sequence longer than the model":
        export = tiny_export(folder / "short.safetensors", block_size=32)
        return (["--data_path", str(corpus), "--init_from", str(export), "--block_size", "64"],
                "--block_size 64 is longer than the 32 positions")
    assert case == "export of another shape"
    export = tiny_export(folder / "wide.safetensors", n_embd=48)
    return (["--data_path", str(corpus), "--init_from", str(export), "--block_size", "32"],
            "does not fit this model: shape of")


@pytest.mark.parametrize("case", ["empty corpus", "odd-sized token file", "sequence longer than the model",
                                  "export of another shape"])
def test_bad_input_is_one_error_line(tmp_path, corpus, case):
    args, message = bad_input(case, tmp_path, corpus)
    args += ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--tracker", "none",
             "--output_dir", str(tmp_path / "run"), "--max_steps", "2"]
    result = subprocess.run([sys.executable, str(TEMPLATE), *args], cwd=REPO, env=clean_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
