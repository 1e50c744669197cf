"""The distributed rules, checked on what a 2-rank DDP run of each template (cpu_ddp.yaml, gloo) does:
only the main process writes the export, shows a progress bar, logs and prints; every loader worker on
every rank draws different random numbers; evaluation counts each validation sample once; the learning
rate is scaled with the world size as --lr_scaling says.

Each template runs once, through a wrapper that runs its main() unchanged and records, per rank, what
the progress bars were told (disabled or not), which rank wrote the export file, and what each loader
worker's random generators give at its first item.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import REPO, launch, load_template, processes_mentioning
from helpers import random_text, read_metrics

WRAPPER = '''
import importlib.util, json, os, random, sys
from pathlib import Path
import numpy as np
import torch

template, record = Path(sys.argv[1]), Path(sys.argv[2])
del sys.argv[1:3]
sys.path.insert(0, str(template.parent.parent))
spec = importlib.util.spec_from_file_location("watched_template", template)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
import common.export
import common.tracking

RANK = int(os.environ.get("RANK", "0"))


def dump(name, data):
    (record / f"{name}.json").write_text(json.dumps(data))


class WatchedBar(common.tracking.tqdm):
    count = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        WatchedBar.count += 1
        dump(f"bar-rank{RANK}-{WatchedBar.count}", {"rank": RANK, "disable": bool(self.disable)})


common.tracking.tqdm = WatchedBar
real_save_file = common.export.save_file


def save_file(tensors, filename, *args, **kwargs):
    dump(f"export-rank{RANK}", {"rank": RANK, "file": str(filename)})
    return real_save_file(tensors, filename, *args, **kwargs)


common.export.save_file = save_file


class WorkerProbe(torch.utils.data.Dataset):
    """Records, in each loader worker, what its generators give first (one copy of this per worker)."""

    def __init__(self, dataset, split):
        self.dataset, self.split, self.recorded = dataset, split, False

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        info = torch.utils.data.get_worker_info()
        if info is not None and not self.recorded:
            self.recorded = True
            dump(f"worker-{self.split}-rank{RANK}-{info.id}", {
                "torch_seed": torch.initial_seed(), "torch": torch.rand(()).item(),
                "numpy": float(np.random.random()), "random": random.random()})
        return self.dataset[index]


data_module = sys.modules["common.data"]  # build_loaders makes both loaders through its build_loader
real_build_loader = data_module.build_loader


def build_loader(dataset, **kwargs):
    return real_build_loader(WorkerProbe(dataset, "train" if kwargs["train"] else "val"), **kwargs)


data_module.build_loader = build_loader
module.main()
'''

BASE_LR = 2e-3
RUN_TIMEOUT_S = 300  # a run takes about 10 s
RUNS = {
    # template -> options; both: 2 loader workers per rank, --lr_scaling linear
    "image_classification": ["--epochs", "1", "--width", "8", "--depth", "1", "--batch_size", "64",
                             "--log_every_steps", "2", "--num_workers", "2"],
    "language_model": ["--data_path", "{corpus}", "--max_steps", "12", "--eval_every_steps", "6", "--eval_batches", "4",
                       "--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--block_size", "16", "--batch_size", "8",
                       "--warmup_steps", "2", "--sample_tokens", "0", "--log_every_steps", "2", "--num_workers", "2"],
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def two_ranks(request, tmp_path_factory):
    template = request.param
    root = tmp_path_factory.mktemp(f"ddp-{template}")
    wrapper, record, output = root / "watch.py", root / "record", root / "run"
    wrapper.write_text(WRAPPER)
    record.mkdir()
    corpus = random_text(root / "corpus.txt", 3000, seed=0)
    args = [a.format(corpus=corpus) for a in RUNS[template]]
    try:
        result = launch("cpu_ddp.yaml", wrapper, str(REPO / "templates" / f"{template}.py"), str(record), *args,
                        "--output_dir", str(output), "--tracker", "none", "--learning_rate", str(BASE_LR),
                        "--lr_scaling", "linear", timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # The launcher is killed; its ranks and their loader workers would live on: end them too.
        left = processes_mentioning(str(record))
        for entry in left:
            os.kill(int(entry.split(":")[0]), signal.SIGKILL)
        pytest.fail(f"RUN HUNG: the 2-rank run did not end within {RUN_TIMEOUT_S} s (a run takes seconds); "
                    f"records: {sorted(p.name for p in record.iterdir())}; killed {len(left)} processes")
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    records = {path.stem: json.loads(path.read_text()) for path in record.glob("*.json")}
    return template, args, output, result, records


def test_the_runs_are_one_job_of_two_ranks(two_ranks):
    _, _, _, result, _ = two_ranks
    assert "2 processes on cpu (MULTI_CPU)" in result.stdout


def test_export_and_progress_bar_on_the_main_process_only(two_ranks):
    _, _, output, _, records = two_ranks
    bars = [r for name, r in records.items() if name.startswith("bar-")]
    assert sorted((bar["rank"], bar["disable"]) for bar in bars) == [(0, False), (1, True)]
    exports = [r for name, r in records.items() if name.startswith("export-")]
    assert [(e["rank"], Path(e["file"]).parent) for e in exports] == [(0, output)]  # .tmp-model.safetensors
    assert (output / "model.safetensors").is_file()


def test_logging_and_printing_happen_once(two_ranks):
    template, _, output, result, _ = two_ranks
    records = read_metrics(output)
    keys = [(record["step"], key) for record in records for key in record if key not in ("step", "time")]
    assert len(keys) == len(set(keys)), "a metric was logged twice for one step"
    assert sum("train/loss" in record for record in records) >= 3
    once = ["2 processes on cpu (MULTI_CPU)"] + (
        ["epoch 1/1: val loss", "final validation accuracy"] if template == "image_classification"
        else ["step 6: val loss", "step 12: val loss", "validation: "])
    for text in once:  # counted anywhere: the ranks' lines can end up on one line of the launcher's output
        assert result.stdout.count(text) == 1, f"{text!r} printed {result.stdout.count(text)} times:\n{result.stdout}"


def test_every_loader_worker_on_every_rank_draws_different_numbers(two_ranks):
    _, _, _, _, records = two_ranks
    workers = {name: r for name, r in records.items() if name.startswith("worker-")}
    # 2 ranks x 2 workers x (training, validation) loaders
    assert sorted(workers) == [f"worker-{split}-rank{rank}-{worker}" for split in ("train", "val")
                               for rank in (0, 1) for worker in (0, 1)]
    for source in ("torch_seed", "torch", "numpy", "random"):
        values = [r[source] for r in workers.values()]
        assert len(set(values)) == len(values), f"workers share {source} numbers: {values}"


def test_evaluation_counts_every_validation_sample_once(two_ranks):
    template, args, output, _, _ = two_ranks
    module = load_template(template)
    cfg = module.parse_config(module.Config, args)
    if template == "image_classification":
        expected, key = len(module.load_datasets(cfg).val), "val/samples"
        assert expected % (2 * cfg.batch_size), "the last batch should be padded on one rank"
    else:
        windows = min(len(module.load_corpus(cfg).val), cfg.eval_batches * cfg.batch_size)
        assert windows % (2 * cfg.batch_size), "the last batch should be padded on one rank"
        expected, key = windows * cfg.block_size, "val/tokens"
    counted = [record[key] for record in read_metrics(output) if key in record]
    assert counted and all(count == expected for count in counted), (counted, expected)


def test_learning_rate_is_scaled_with_the_world_size_as_asked(two_ranks):
    """--lr_scaling linear on 2 ranks: twice --learning_rate, printed, and the schedule follows it step by step."""
    from common.optim import warmup_cosine

    template, args, output, result, _ = two_ranks
    scaled = 2 * BASE_LR
    assert re.search(rf"learning rate {scaled:g}$", result.stdout, re.M), result.stdout[-2000:]
    module = load_template(template)
    cfg = module.parse_config(module.Config, args)
    total = int(re.search(r"(\d+) optimizer steps", result.stdout).group(1))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=scaled)
    scheduler = warmup_cosine(optimizer, min(cfg.warmup_steps, total // 2), total)
    planned = {}
    for step in range(1, total + 1):
        optimizer.step()
        scheduler.step()
        planned[step] = scheduler.get_last_lr()[0]
    logged = [(record["step"], record["lr"]) for record in read_metrics(output) if "lr" in record]
    assert logged
    for step, lr in logged:
        assert lr == pytest.approx(planned[step], rel=1e-9), (step, lr, planned[step])
