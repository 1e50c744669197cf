"""templates/image_classification.py end to end, through real `accelerate launch` processes.

Every run is tiny (digits, width 8, depth 1, 2 epochs, no W&B) and takes seconds on a CPU. Runs
that several tests read (the plain run, the 1-process and 2-rank baselines) are module fixtures,
so each happens once per session.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import REPO, clean_env, copy_into_monorepo, copy_template_alone, launch, load_template
from helpers import is_png, read_metrics, snapshot
from common.errors import read_status
from common.optim import warmup_cosine

TEMPLATE = REPO / "templates" / "image_classification.py"
TINY = ("--epochs", "2", "--width", "8", "--depth", "1", "--tracker", "none")
# What resume exactness is tested with: dropout, shuffled data, loader workers, augmentation (on by
# default) and gradient accumulation. Batch 40 gives 35 micro-batches per epoch on one process (odd:
# the last optimizer step of each epoch has a single micro-batch), 18 optimizer steps per epoch;
# on two ranks 17 micro-batches each, 9 steps per epoch.
EXACT = TINY + ("--batch_size", "40", "--gradient_accumulation_steps", "2", "--dropout", "0.3", "--num_workers", "2")
EXACT_STEPS_PER_EPOCH = {1: 18, 2: 9}
DIGITS_TRAIN, DIGITS_VAL = 1438, 359


# ------------------------------------------------------------------------------------- helpers
def show(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-5000:]}"


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, show(result)
    return result


def run_template(config: str, output_dir: Path, *args: str, num_processes: int | None = None,
                 curves: bool = False) -> subprocess.CompletedProcess:
    """`curves`: draw curves.png at the end, as outside the suite (conftest.py turns it off)."""
    return ok(launch(config, TEMPLATE, *args, "--output_dir", str(output_dir), num_processes=num_processes,
                     env=clean_env(CURVES_PNG="1") if curves else None))


def val_records(output_dir: Path) -> list[dict]:
    return [record for record in read_metrics(output_dir) if "val/accuracy" in record]


def optimizer_steps(stdout: str) -> int:
    match = re.search(r"(\d+) optimizer steps", stdout)
    assert match, stdout
    return int(match.group(1))


def progress_of(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "progress.json").read_text())


def differing_tensors(a: Path | dict, b: Path | dict) -> list[str]:
    """Names of the tensors that are not bit-identical (torch.equal) between two state dicts or exports."""
    a = load_file(str(a)) if isinstance(a, Path) else a
    b = load_file(str(b)) if isinstance(b, Path) else b
    assert sorted(a) == sorted(b)
    return [key for key in sorted(a) if not torch.equal(a[key], b[key])]


def evaluate_export(export: Path, *args: str) -> dict[str, float]:
    """Load the export into the plain ResNet the template builds and score it on the validation split.

    In batches of --batch_size, in order, as the template evaluates on one process, so the numbers compare.
    """
    from common.export import load_exported

    module = load_template("image_classification")
    cfg = module.parse_config(module.Config, list(args))
    data = module.load_datasets(cfg)
    val_set, model = data.val, module.build_model(cfg, data)
    assert isinstance(model, module.ResNet)
    load_exported(model, export)
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(val_set), cfg.batch_size):
            images, labels = zip(*(val_set[i] for i in range(start, min(start + cfg.batch_size, len(val_set)))))
            logits = model(torch.stack(images))
            labels = torch.as_tensor(labels)
            loss += F.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(-1) == labels).sum().item()
    return {"val/loss": loss / len(val_set), "val/accuracy": correct / len(val_set), "val/samples": len(val_set)}


def assert_export_reproduces_metrics(output_dir: Path, *args: str) -> None:
    final = val_records(output_dir)[-1]
    scored = evaluate_export(output_dir / "model.safetensors", *args)
    assert scored["val/samples"] == final["val/samples"] == DIGITS_VAL
    assert scored["val/loss"] == pytest.approx(final["val/loss"], rel=1e-5), (scored, final)
    assert abs(scored["val/accuracy"] - final["val/accuracy"]) * DIGITS_VAL <= 1, (scored, final)  # a near-tie may flip


# A wrapper that runs the template's main() unchanged and, when the template exports the final
# weights (it calls export_weights on every rank), first dumps what this rank holds and how it is
# wired into the job. The dumps are each rank's live parameters at the end of training.
RANK_DUMP_WRAPPER = '''
import importlib.util, sys
import torch
import torch.distributed as dist

template, dump_dir = sys.argv[1], sys.argv[2]
del sys.argv[1:3]
spec = importlib.util.spec_from_file_location("image_classification", template)
module = importlib.util.module_from_spec(spec)
sys.modules["image_classification"] = module
spec.loader.exec_module(module)
export_weights = module.export_weights

def dump_then_export(accelerator, model, path, **kwargs):
    torch.save({
        "rank": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "dist_world_size": dist.get_world_size() if dist.is_initialized() else None,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "wrapper": type(model).__name__,
        "state": {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
    }, f"{dump_dir}/rank{accelerator.process_index}.pt")
    return export_weights(accelerator, model, path, **kwargs)

module.export_weights = dump_then_export
module.main()
'''


# ------------------------------------------------------------------------------- shared runs
@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """accelerate_configs/cpu.yaml, default batch size: the demo run."""
    out = tmp_path_factory.mktemp("plain") / "run"
    result = run_template("cpu.yaml", out, *TINY, curves=True)
    return out, result


@pytest.fixture(scope="module")
def single_baseline(tmp_path_factory):
    """One process, the EXACT flags, uninterrupted."""
    out = tmp_path_factory.mktemp("single") / "run"
    return out, run_template("cpu.yaml", out, *EXACT)


@pytest.fixture(scope="module")
def ddp_baseline(tmp_path_factory):
    """Two gloo ranks (cpu_ddp.yaml), the EXACT flags, uninterrupted, each rank's final weights dumped."""
    root = tmp_path_factory.mktemp("ddp")
    wrapper, dumps, out = root / "dump_ranks.py", root / "dumps", root / "run"
    wrapper.write_text(RANK_DUMP_WRAPPER)
    dumps.mkdir()
    result = ok(launch("cpu_ddp.yaml", wrapper, str(TEMPLATE), str(dumps), *EXACT, "--output_dir", str(out)))
    ranks = {path.name: torch.load(path, weights_only=True) for path in sorted(dumps.glob("rank*.pt"))}
    return out, result, ranks


# ------------------------------------------------------------------------------------ 1. cpu.yaml
def test_cpu_run_writes_the_documented_outputs(plain_run, tmp_path):
    out, result = plain_run
    assert "1 process on cpu, mixed precision" in result.stdout
    final = r"^final validation accuracy: \d+\.\d\d% \(best \d+\.\d\d% at step \d+\)$"
    assert re.search(final, result.stdout, re.M), result.stdout
    run = json.loads((out / "run.json").read_text())
    assert run["template"] == "image_classification" and run["config"]["epochs"] == 2
    vals = val_records(out)
    assert [record["epoch"] for record in vals] == [1, 2]
    assert all(0.0 <= record["val/accuracy"] <= 1.0 and record["val/samples"] == DIGITS_VAL for record in vals)
    names = sorted(path.name for path in (out / "checkpoints").iterdir())
    assert any(re.fullmatch(r"step_\d{8}", name) for name in names), names
    assert any(re.fullmatch(r"best_step_\d{8}", name) for name in names), names
    assert not [name for name in names if name.startswith(".tmp-")], names
    assert (out / "model.safetensors").is_file()
    # the run's curves, drawn by the main process at its end from metrics.jsonl, its best checkpoint marked
    from common.curves import best_checkpoint_step, curves_figure, metric_series, save_figure

    assert is_png(out / "curves.png") and best_checkpoint_step(out) is not None
    series = metric_series(read_metrics(out))
    save_figure(curves_figure({str(out): series}, {str(out): best_checkpoint_step(out)}, title=str(out)),
                tmp_path / "expected.png")
    assert (out / "curves.png").read_bytes() == (tmp_path / "expected.png").read_bytes()


def test_cpu_export_loads_into_the_plain_model(plain_run):
    out, _ = plain_run
    assert_export_reproduces_metrics(out, *TINY)


# ------------------------------------------------------------------------------ 2. cpu_ddp.yaml
def test_ddp_ranks_form_one_job(ddp_baseline, single_baseline):
    out, result, ranks = ddp_baseline
    assert "2 processes on cpu (MULTI_CPU)" in result.stdout
    assert f"{DIGITS_TRAIN} training / {DIGITS_VAL} validation images" in result.stdout
    # Stronger than the log line: what each rank saw of the process group and its model wrapper ...
    assert sorted(ranks) == ["rank0.pt", "rank1.pt"]
    for name, dump in ranks.items():
        assert (dump["num_processes"], dump["dist_world_size"], dump["backend"]) == (2, 2, "gloo"), name
        assert dump["wrapper"] == "DistributedDataParallel", name
    # ... and the data really was split: half the optimizer steps of one process on the same flags.
    assert optimizer_steps(single_baseline[1].stdout) == 2 * EXACT_STEPS_PER_EPOCH[1]
    assert optimizer_steps(result.stdout) == 2 * EXACT_STEPS_PER_EPOCH[2]
    assert [record["step"] for record in val_records(out)] == [EXACT_STEPS_PER_EPOCH[2], 2 * EXACT_STEPS_PER_EPOCH[2]]


def test_ddp_ranks_end_with_identical_parameters(ddp_baseline):
    out, _, ranks = ddp_baseline
    rank0, rank1 = ranks["rank0.pt"]["state"], ranks["rank1.pt"]["state"]
    assert differing_tensors(rank0, rank1) == []
    assert differing_tensors(rank0, load_file(str(out / "model.safetensors"))) == []  # and the export is that


def test_ddp_validation_counts_every_sample_once(ddp_baseline):
    out, _, _ = ddp_baseline
    batch_size = int(EXACT[EXACT.index("--batch_size") + 1])
    assert DIGITS_VAL % (2 * batch_size) != 0  # so the last batch is padded on one rank
    assert [record["val/samples"] for record in val_records(out)] == [DIGITS_VAL, DIGITS_VAL]


def _expected_lr(step: int, total_steps: int) -> float:
    """What warmup_cosine, sized as the template sizes it, gives after `step` optimizer steps."""
    from common.optim import warmup_cosine

    cfg = load_template("image_classification").Config()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.learning_rate)
    scheduler = warmup_cosine(optimizer, min(cfg.warmup_steps, total_steps // 2), total_steps)
    for _ in range(step):
        optimizer.step()
        scheduler.step()
    return scheduler.get_last_lr()[0]


@pytest.mark.parametrize("processes", [1, 2], ids=["1-process", "2-ddp-ranks"])
def test_learning_rate_follows_the_schedule_per_optimizer_step(processes, single_baseline, ddp_baseline):
    """On N ranks the schedule must still advance once per optimizer step (accelerate's default is N times)."""
    out = (single_baseline if processes == 1 else ddp_baseline)[0]
    total = 2 * EXACT_STEPS_PER_EPOCH[processes]
    logged = [record for record in read_metrics(out) if "lr" in record]
    assert logged
    for record in logged:
        assert record["lr"] == pytest.approx(_expected_lr(record["step"], total), rel=1e-9), record


# --------------------------------------------------------------------------------- 3. fsdp.yaml
def test_fsdp_trains_sharded_resumes_and_exports(tmp_path, ddp_baseline):
    out = tmp_path / "run"
    first = run_template("fsdp.yaml", out, *EXACT, "--stop_after_steps", "4", num_processes=2)
    assert "2 processes on cpu (FSDP)" in first.stdout
    assert "stopped at step 4" in first.stdout
    assert not (out / "model.safetensors").exists()
    checkpoint = out / "checkpoints" / "step_00000004"
    # SHARDED_STATE_DICT: one shard per rank of the model and of the optimizer, no full copy.
    shards = sorted(p.name for p in (checkpoint / "pytorch_model_fsdp_0").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert len(list((checkpoint / "optimizer_0").glob("*.distcp"))) == 2
    assert not (checkpoint / "model.safetensors").exists()

    second = run_template("fsdp.yaml", out, *EXACT, "--resume", "auto", num_processes=2)
    assert "2 processes on cpu (FSDP)" in second.stdout
    assert f"resumed from {checkpoint} at step 4" in second.stdout
    assert "final validation accuracy" in second.stdout
    assert [record["epoch"] for record in val_records(out)] == [1, 2]
    assert_export_reproduces_metrics(out, *EXACT)  # the gathered export loads into the plain model here
    # Sharded training resumed from shards ends where uninterrupted DDP on the same flags does: same
    # data order, RNG streams and math. Not bit for bit: torch's fused CPU AdamW rounds differently in its
    # vectorized loop and its scalar tail, and sharding a 10-element bias into 5 + 5 moves it to the tail;
    # Adam's normalized updates carry such last-bit differences along (2e-4 at most after 2 epochs here).
    # A sharding bug (a shard trained twice, a wrong slice, a missed all-reduce) moves weights by far more.
    fsdp, ddp = load_file(str(out / "model.safetensors")), load_file(str(ddp_baseline[0] / "model.safetensors"))
    for key in ddp:
        torch.testing.assert_close(fsdp[key], ddp[key], rtol=0, atol=2e-3, msg=lambda m, key=key: f"{key}: {m}")


# ------------------------------------------------------------------------------ 4. exact resume
@pytest.mark.parametrize(
    "config, processes, baseline",
    [("cpu.yaml", 1, "single_baseline"), ("cpu_ddp.yaml", 2, "ddp_baseline")],
    ids=["1-process", "2-ddp-ranks"],
)
def test_stopped_and_resumed_run_is_bit_identical(config, processes, baseline, tmp_path, request):
    """Stop mid-epoch 1, resume and stop again after crossing into epoch 2, resume to the end (naming the run
    folder, as `--resume runs/image_classification` would)."""
    reference = request.getfixturevalue(baseline)[0]
    per_epoch = EXACT_STEPS_PER_EPOCH[processes]
    first_stop, second_stop = per_epoch // 2 - 1, per_epoch + 2
    out = tmp_path / "run"

    result = run_template(config, out, *EXACT, "--stop_after_steps", str(first_stop), curves=True)
    assert f"stopped at step {first_stop}" in result.stdout
    stopped_picture = (out / "curves.png").read_bytes()  # a stopped run draws its curves too
    status = read_status(out)  # the end state, as written behind `accelerate launch`
    assert (status["state"], status["exit_code"], status["step"]) == ("stopped", 0, first_stop), status
    assert status["reason"] == "--stop_after_steps"
    progress = progress_of(out / "checkpoints" / f"step_{first_stop:08d}")
    assert (progress["epoch"], progress["batches_in_epoch"]) == (0, 2 * first_stop)  # mid-epoch 1

    result = run_template(config, out, *EXACT, "--resume", "auto", "--stop_after_steps", str(second_stop - first_stop))
    assert f"at step {first_stop} (epoch 0, batch {2 * first_stop})" in result.stdout
    assert f"stopped at step {second_stop}" in result.stdout
    progress = progress_of(out / "checkpoints" / f"step_{second_stop:08d}")
    # crossed into epoch 2
    assert (progress["epoch"], progress["batches_in_epoch"]) == (1, 2 * (second_stop - per_epoch))

    result = run_template(config, out, *EXACT, "--resume", str(out), curves=True)  # a run folder: its newest one
    assert f"resumed from {out / 'checkpoints' / f'step_{second_stop:08d}'}" in result.stdout
    assert "final validation accuracy" in result.stdout
    assert read_status(out)["state"] == "finished"
    assert stopped_picture.startswith(b"\x89PNG") and is_png(out / "curves.png")
    assert (out / "curves.png").read_bytes() != stopped_picture  # drawn again, from all three sessions

    assert differing_tensors(out / "model.safetensors", reference / "model.safetensors") == []
    strip = lambda records: [{k: v for k, v in r.items() if k != "time"} for r in records]  # noqa: E731
    assert strip(val_records(out)) == strip(val_records(reference))


def test_more_epochs_extend_a_finished_run_and_the_extension_resumes_exactly(tmp_path):
    """A 1-epoch run trained to its end, then the README's command for more: the same run with --epochs 2 goes on
    from step 18 under the schedule of 36 steps. Stopped part-way and resumed with that command, it ends
    bit-identical to the extension uninterrupted from the same checkpoint. (A shorter run is refused:
    test_checkpoint.py.)"""
    out, reference = tmp_path / "run", tmp_path / "reference"
    per_epoch = EXACT_STEPS_PER_EPOCH[1]
    run_template("cpu.yaml", out, *EXACT, "--epochs", "1")
    assert read_status(out)["state"] == "finished"
    shutil.copytree(out, reference)

    # warmup min(50, 18 // 2) then cosine to 0.1 of 2e-3 at step 18; over 36 steps the warmup is 18: the peak
    extending = (f"extending the run from --epochs 1 to 2 ({per_epoch} to {2 * per_epoch} optimizer steps); the "
                 f"learning rate at step {per_epoch} changes from 0.0002 to 0.002 (the warmup and cosine of the new "
                 "length from here on)")
    result = run_template("cpu.yaml", reference, *EXACT, "--epochs", "2")
    assert extending in result.stdout and "epoch 2/2" in result.stdout
    stop = per_epoch + 5
    result = run_template("cpu.yaml", out, *EXACT, "--epochs", "2", "--stop_after_steps", "5")
    assert extending in result.stdout and f"stopped at step {stop}" in result.stdout
    result = run_template("cpu.yaml", out, *EXACT, "--epochs", "2")
    assert f"resumed from {out / 'checkpoints' / f'step_{stop:08d}'}" in result.stdout
    assert "extending" not in result.stdout  # its checkpoint recorded the new length
    assert (read_status(out)["state"], read_status(out)["step"]) == ("finished", 2 * per_epoch)

    assert differing_tensors(out / "model.safetensors", reference / "model.safetensors") == []
    strip = lambda records: [{k: v for k, v in r.items() if k != "time"} for r in records]  # noqa: E731
    assert strip(val_records(out)) == strip(val_records(reference))
    logged_lr = {r["step"]: r["lr"] for r in read_metrics(out) if "lr" in r}  # every 10 steps: the next step's
    longer = warmup_cosine(torch.optim.SGD([torch.zeros(1)], lr=1), per_epoch, 2 * per_epoch).lr_lambdas[0]
    assert logged_lr[20] == pytest.approx(2e-3 * longer(20))



def test_init_from_starts_a_new_run_from_a_finished_runs_weights(tmp_path, plain_run):
    """`--init_from <run folder>` in another --output_dir: a new run (its own optimizer and schedule) whose model
    starts as the finished run's export. With a learning rate too small to move it, it ends where it started."""
    out = tmp_path / "new"
    result = run_template("cpu.yaml", out, *TINY, "--epochs", "1", "--init_from", str(plain_run[0]),
                          "--learning_rate", "1e-12")
    assert "resumed from" not in result.stdout and progress_of(out / "checkpoints" / "step_00000022")["step"] == 22
    start, end = load_file(str(plain_run[0] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert start.keys() == end.keys() and all(torch.allclose(start[k], end[k], rtol=0, atol=1e-9) for k in start)
    assert val_records(out)[-1]["val/loss"] == pytest.approx(val_records(plain_run[0])[-1]["val/loss"], rel=1e-6)


def test_weight_comparison_detects_a_different_run(tmp_path, single_baseline):
    """Negative control for the test above: another seed, same flags, must not compare equal."""
    out = tmp_path / "run"
    run_template("cpu.yaml", out, *EXACT, "--seed", "1")
    assert differing_tensors(out / "model.safetensors", single_baseline[0] / "model.safetensors") != []


# ------------------------------------------------------------------------------- 5. copyability
def test_template_and_common_alone_train_in_an_empty_folder(tmp_path):
    app, env = copy_template_alone("image_classification", tmp_path)
    tiny = ("--epochs", "1", "--width", "8", "--depth", "1", "--tracker", "none")
    launched = launch("cpu.yaml", app / "image_classification.py", *tiny, cwd=app, env=env)
    assert launched.returncode == 0, show(launched)
    assert "final validation accuracy" in launched.stdout
    assert (app / "runs" / "image_classification" / "model.safetensors").is_file()  # the default output_dir

    plain = subprocess.run([sys.executable, "image_classification.py", *tiny, "--output_dir", "runs/plain"],
                           cwd=app, env=env, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, show(plain)
    assert "final validation accuracy" in plain.stdout
    assert (app / "runs" / "plain" / "model.safetensors").is_file()
    assert sorted(p.name for p in app.iterdir()) == ["common", "image_classification.py", "runs"]


@pytest.mark.parametrize("shadow", ["module", "package"])
def test_a_copy_inside_a_monorepo_imports_its_own_common_not_the_one_above_it(tmp_path, shadow):
    proj, env = copy_into_monorepo("image_classification", tmp_path, shadow)
    tiny = ("--epochs", "1", "--width", "8", "--depth", "1", "--batch_size", "512", "--tracker", "none")
    launched = launch("cpu.yaml", proj / "train.py", *tiny, "--output_dir", str(proj / "runs" / "x"), cwd=proj.parent,
                      env=env)
    assert launched.returncode == 0, show(launched)
    assert "final validation accuracy" in launched.stdout and (proj / "runs" / "x" / "model.safetensors").is_file()


IMPORT_ORDERS = {  # how a program of the monorepo (a notebook at its root) meets the template, the project's folder
    # after the monorepo's own on sys.path (as the README says: first, its `common` would be the one Python finds)
    "monorepo-common-first": "import common.strings; sys.path.append('proj'); from train import ResNet, main",
    "template-first": "sys.path.append('proj'); import train; from train import ResNet, main; import common.strings",
}
IN_ONE_PROCESS = """
import sys
{imports}
import common
model = ResNet(in_channels=1, num_classes=10, width=8, depth=1, stages=3, dropout=0.0)
metrics = main(["--epochs", "1", "--width", "8", "--depth", "1", "--batch_size", "512", "--tracker", "none",
                "--num_workers", "0", "--output_dir", "proj/runs/x"])
import common.strings
from common.strings import shout
# the README's export snippet, where `common` is the monorepo's: the template's own is `train.common`
import train
path = "proj/runs/x/model.safetensors"
info = train.common.export.export_info(path)
loaded = train.common.export.load_exported(ResNet(**info["model"]).eval(), path)
print(common.OWNER, shout("still theirs"), "val/accuracy" in metrics, info["classes"][:2])
"""


@pytest.mark.parametrize("order", list(IMPORT_ORDERS))
def test_a_copy_imported_by_a_monorepo_program_leaves_its_common_alone_in_either_order(tmp_path, order):
    """The README's `from train import ResNet` in a notebook of a repository whose own `common` package is imported
    before or after: each side keeps its own `common`, and the template still trains in that process."""
    proj, env = copy_into_monorepo("image_classification", tmp_path, "package")
    code = IN_ONE_PROCESS.format(imports=IMPORT_ORDERS[order])
    result = subprocess.run([sys.executable, "-c", code], cwd=proj.parent, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, show(result)
    assert result.stdout.splitlines()[-1] == "the monorepo STILL THEIRS True ['0', '1']", show(result)
    assert (proj / "runs" / "x" / "model.safetensors").is_file()


# ------------------------------------------------------------------------------- 6. bad input
BAD_INPUTS = {
    "unknown-flag": (["--epoch", "3"], "unknown option --epoch"),
    "wrong-type": (["--epochs=abc"], "--epochs: expected an integer, got 'abc'"),
    "missing-data-dir": (["--data_dir", "{tmp}/no_such_folder"], "no_such_folder: no such folder"),
    "empty-data-dir": (["--data_dir", "{tmp}/empty"], "need at least 2 class folders"),
    "resume-nonexistent": (["--resume", "/nonexistent"], "--resume /nonexistent: no such checkpoint or run folder"),
    "resume-none-over-a-run": (["--resume", "none"], "already holds checkpoints"),
    "init-from-another-shape": (["--init_from", "{tmp}/existing_run", "--width", "16"],
                                "existing_run/model.safetensors does not fit this model: shape of "),
    "resume-folder-without-checkpoints": (["--resume", "{tmp}/empty"], "/empty: neither a complete "
                                          "checkpoint (no progress.json) nor a run folder with one; pass a run's "
                                          "--output_dir, one of its checkpoints/step_* folders, auto or none"),
}
MODES = ("python", "accelerate")


@pytest.fixture(scope="module")
def bad_runs(plain_run, tmp_path_factory):
    """Every bad invocation, both ways, pointed at a copy of a finished run's output folder (concurrently: they
    are short)."""
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "empty").mkdir()
    existing = tmp / "existing_run"
    shutil.copytree(plain_run[0], existing)
    before = snapshot(existing)

    def run(case: str, mode: str) -> subprocess.CompletedProcess:
        args = [a.format(tmp=tmp) for a in BAD_INPUTS[case][0]] + ["--tracker", "none", "--output_dir", str(existing)]
        if mode == "python":
            return subprocess.run([sys.executable, str(TEMPLATE), *args], cwd=REPO, env=clean_env(),
                                  capture_output=True, text=True, timeout=120)
        return launch("cpu.yaml", TEMPLATE, *args, launcher_args=("-q",), timeout=120)

    keys = [(case, mode) for case in BAD_INPUTS for mode in MODES]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip(keys, pool.map(lambda key: run(*key), keys)))
    return results, existing, before


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_direct_is_one_error_line(case, bad_runs):
    result = bad_runs[0][(case, "python")]
    assert result.returncode == 2, show(result)
    assert result.stderr.splitlines() == [result.stderr.strip()], show(result)  # exactly one line
    assert result.stderr.startswith("error: ") and BAD_INPUTS[case][1] in result.stderr, show(result)
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_through_accelerate_launch(case, bad_runs):
    result = bad_runs[0][(case, "accelerate")]
    assert result.returncode != 0, show(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and BAD_INPUTS[case][1] in errors[0], show(result)
    assert "Traceback" not in result.stdout + result.stderr, show(result)


def test_bad_input_leaves_an_existing_run_untouched(bad_runs):
    _, existing, before = bad_runs
    assert (existing / "checkpoints").is_dir() and before  # the folder held a finished run
    assert snapshot(existing) == before


# ----------------------------------------------------------------------------- 7. --data_dir
CLASSES = ("red_solid", "green_hstripes", "blue_vstripes")


def draw(kind: str, index: int):
    """A 20x20 image of one of three easy patterns, with a per-image shade so no two are equal."""
    from PIL import Image

    shade = 120 + (index * 37) % 120
    image = Image.new("RGB", (20, 20), (20, 20, 20))
    pixels = image.load()
    for y in range(20):
        for x in range(20):
            if kind == "red_solid":
                pixels[x, y] = (shade, 30, 30)
            elif kind == "green_hstripes" and (y // 2) % 2 == 0:
                pixels[x, y] = (30, shade, 30)
            elif kind == "blue_vstripes" and (x // 2) % 2 == 0:
                pixels[x, y] = (30, 30, shade)
    return image


def write_images(root: Path, per_class: int, start: int = 0) -> None:
    for kind in CLASSES:
        (root / kind).mkdir(parents=True)
        for index in range(start, start + per_class):
            draw(kind, index).save(root / kind / f"{index:03d}.png")


DATA_ARGS = ("--image_size", "16", "--epochs", "3", "--batch_size", "8", "--width", "8", "--depth", "1",
             "--tracker", "none")


@pytest.mark.parametrize("layout", ["flat", "train-val"])
def test_image_folder_data_trains(layout, tmp_path):
    data = tmp_path / "images"
    if layout == "flat":
        write_images(data, 30)  # split by a hash of each path
    else:
        write_images(data / "train", 24)
        write_images(data / "val", 6, start=24)
    out = tmp_path / "run"
    result = run_template("cpu.yaml", out, "--data_dir", str(data), *DATA_ARGS)
    counts = re.search(r"(\d+) training / (\d+) validation images", result.stdout)
    train, val = int(counts.group(1)), int(counts.group(2))
    assert train + val == 90 and train > val > 0
    if layout == "train-val":
        assert (train, val) == (72, 18)
    vals = val_records(out)
    assert [record["val/samples"] for record in vals] == [val] * 3
    assert "final validation accuracy" in result.stdout
    assert vals[-1]["val/accuracy"] >= 0.9, vals  # three easy classes (chance: 1/3); it reaches 100% here
    if layout == "train-val":  # the export alone names its classes and rebuilds the model: classify the images
        info = json.loads((out / "run.json").read_text())["model"]
        probe = subprocess.run([sys.executable, "-c", USE_EXPORT, str(REPO), str(out / "model.safetensors"),
                                str(data / "val")], capture_output=True, text=True, timeout=120, env=clean_env())
        assert probe.returncode == 0, probe.stderr[-3000:]
        result = json.loads(probe.stdout)
        assert result["info"] == info and result["info"]["classes"] == sorted(CLASSES)
        assert result["right"] >= 0.9 * result["total"] and result["total"] == 18, result


# A separate Python process that knows only the export and the template's model code (argv: repo, export, folder).
USE_EXPORT = """
import importlib.util, json, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
spec = importlib.util.spec_from_file_location("template", Path(sys.argv[1]) / "templates" / "image_classification.py")
template = importlib.util.module_from_spec(spec)
sys.modules["template"] = template
spec.loader.exec_module(template)
from common.export import export_info, load_exported
info = export_info(sys.argv[2])
model = template.ResNet(**info["model"]).eval()
load_exported(model, sys.argv[2])
right = total = 0
for folder in sorted(Path(sys.argv[3]).iterdir()):
    paths = sorted(folder.iterdir())
    images = template.ImageFiles(paths, [0] * len(paths), info["image_size"])
    with torch.no_grad():
        outputs = model(torch.stack([images[i][0] for i in range(len(paths))]))
    named = [info["classes"][i] for i in outputs.argmax(-1).tolist()]
    right += sum(name == folder.name for name in named)
    total += len(paths)
print(json.dumps({"info": info, "right": right, "total": total}))
"""
