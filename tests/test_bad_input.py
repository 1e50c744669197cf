"""The bad-input battery: wrong flags, values, data, checkpoints, folders, config and sweep files.

Every case runs the real program directly (`python templates/<x>.py ...` or `python -m search ...`)
and must end with exactly one `error:` line naming the problem, a non-zero exit (2), no traceback,
and nothing already saved changed: each case points at its own copy of finished runs of both
templates and of a search study, whose every file (path, size, mtime, sha256) is compared before
and after. Cases run two at a time; some repeat checks made elsewhere, as the battery is the
README's figure.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import REPO, clean_env

IMAGE = REPO / "templates" / "image_classification.py"
LM = REPO / "templates" / "language_model.py"
FAKE = REPO / "tests" / "fake_trial.py"
TINY_IMAGE = ["--epochs", "1", "--width", "8", "--depth", "1", "--batch_size", "512", "--tracker", "none"]
TINY_LM = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--batch_size", "8", "--max_steps", "2",
           "--eval_every_steps", "0", "--eval_batches", "1", "--sample_tokens", "0", "--tracker", "none"]
PROGRESS_BAR = re.compile(r"^train:\s+\d+%\|")


@dataclass(frozen=True)
class Case:
    program: str  # image, lm or search
    args: tuple[str, ...]  # {image_run}, {lm_run}, {study}, {data}, {fresh} are filled in
    expected: str  # part of the one error line
    output: str | None = None  # --output_dir (templates): the copy of a finished run it may not change; default by program


def lm_checkpoint() -> str:
    return "{lm_run}/checkpoints/step_00000002"


CASES = {
    # -- image template: flags and values
    "image/unknown-flag": Case("image", ("--epoch", "3"), "unknown option --epoch (did you mean --epochs?)"),
    "image/wrong-type": Case("image", ("--epochs=abc",), "--epochs: expected an integer, got 'abc'"),
    "image/negative-learning-rate": Case("image", ("--learning_rate", "-1e-3"), "learning_rate must be > 0, got -0.001"),
    "image/batch-size-0": Case("image", ("--batch_size", "0"), "batch_size must be at least 1, got 0"),
    "image/accumulation-0": Case("image", ("--gradient_accumulation_steps", "0"), "gradient_accumulation_steps must be at least 1, got 0"),
    "image/dropout-out-of-range": Case("image", ("--dropout", "1.5"), "dropout must be in [0, 1), got 1.5"),
    # -- image template: data
    "image/missing-data-dir": Case("image", ("--data_dir", "{data}/no_such_folder"), "no_such_folder: no such folder"),
    "image/empty-data-dir": Case("image", ("--data_dir", "{data}/empty"), "need at least 2 class folders"),
    "image/corrupt-image": Case("image", ("--data_dir", "{data}/images", "--image_size", "16", "--batch_size", "8", "--num_workers", "0"),
                                "cannot read image {data}/images/", output="{fresh}"),
    "image/corrupt-image-in-a-worker": Case("image", ("--data_dir", "{data}/images", "--image_size", "16", "--batch_size", "8",
                                                      "--num_workers", "2"), "cannot read image {data}/images/", output="{fresh}"),
    # -- image template: checkpoints and output folders
    "image/checkpoint-of-another-shape": Case("image", ("--width", "16"), "does not fit this model and optimizer: "),
    "image/checkpoint-of-another-template": Case("image", ("--resume", lm_checkpoint()),
                                                 "was written by template 'language_model', not 'image_classification'"),
    "image/resume-path-missing": Case("image", ("--resume", "{data}/no_such_checkpoint"), "no_such_checkpoint: no such checkpoint folder"),
    "image/folder-of-another-run": Case("image", ("--resume", "none"), "already holds checkpoints of a run (newest: "),
    "image/folder-of-another-template": Case("image", (), "holds a run of template 'language_model'; choose another --output_dir",
                                             output="{lm_run}"),
    # -- config files
    "config/missing": Case("image", ("--config", "{data}/missing.yaml"), "missing.yaml: not found"),
    "config/not-yaml": Case("image", ("--config", "{data}/broken.yaml"), "broken.yaml: not valid YAML"),
    "config/wrong-type": Case("image", ("--config", "{data}/wrong_type.yaml"), "wrong_type.yaml: label_smoothing: expected a number, got 'lots'"),
    "config/unknown-key": Case("lm", ("--config", "{data}/unknown_key.yaml"), "unknown_key.yaml: unknown key 'max_step' (did you mean max_steps?)"),
    # -- language-model template
    "lm/not-a-multiple-of-heads": Case("lm", ("--n_embd", "30", "--n_head", "4"), "n_embd (30) must be a multiple of n_head (4)"),
    "lm/max-steps-0": Case("lm", ("--max_steps", "0"), "max_steps must be at least 1, got 0"),
    "lm/missing-corpus": Case("lm", ("--data_path", "{data}/no_such_corpus.txt"), "no_such_corpus.txt: no such file or folder"),
    "lm/empty-corpus": Case("lm", ("--data_path", "{data}/empty.txt"), "empty corpus, no bytes to train on"),
    "lm/corpus-too-short-for-a-batch": Case("lm", ("--data_path", "{data}/short.txt", "--val_fraction", "0.5"),
                                            "4 training windows make no full batch of 8 per process"),
    "lm/odd-token-file": Case("lm", ("--data_path", "{data}/odd.bin"), "has 3 bytes, not a multiple of 2"),
    "lm/checkpoint-of-another-shape": Case("lm", ("--data_path", "{data}/corpus.txt", "--n_embd", "64"),
                                           "does not fit this model and optimizer: "),
    # -- the search runner
    "search/unknown-flag": Case("search", ("--sweep", "{data}/sweep.yaml", "--n_trial", "3"), "unknown option --n_trial (did you mean --n_trials?)"),
    "search/n-trials-0": Case("search", ("--sweep", "{data}/sweep.yaml", "--n_trials", "0"), "n_trials must be at least 1"),
    "search/missing-sweep": Case("search", ("--sweep", "{data}/no_such_sweep.yaml"), "no_such_sweep.yaml: not found"),
    "search/invalid-sweep": Case("search", ("--sweep", "{data}/invalid_sweep.yaml"), "parameter learning_rate: unknown distribution 'loguniform'"),
    "search/missing-accelerate-config": Case("search", ("--sweep", "{data}/missing_config_sweep.yaml"),
                                             "the command's --config_file accelerate_configs/no_such_config.yaml does not exist"),
}


def snapshot(root: Path) -> dict[str, tuple]:
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_size if p.is_file() else 0, p.stat().st_mtime_ns,
                                       hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def write_data(data: Path) -> None:
    from PIL import Image

    (data / "empty").mkdir(parents=True)
    for c, name in enumerate(("red", "green", "blue")):
        (data / "images" / name).mkdir(parents=True)
        for i in range(8):
            color = [40, 40, 40]
            color[c] = 100 + 15 * i
            Image.new("RGB", (20, 20), tuple(color)).save(data / "images" / name / f"{i}.png")
    (data / "images" / "green" / "broken.png").write_bytes(b"these bytes are no PNG")  # corrupt, in one split or the other
    (data / "broken.yaml").write_text("epochs: [1, 2\n")
    (data / "wrong_type.yaml").write_text("label_smoothing: lots\n")
    (data / "unknown_key.yaml").write_text("max_step: 10\n")
    (data / "empty.txt").write_bytes(b"")
    (data / "short.txt").write_bytes(b"abcdefghij" * 30)  # 300 bytes: 4 + 4 windows of 32 tokens
    rng = np.random.default_rng(0)
    (data / "corpus.txt").write_bytes(bytes(rng.integers(97, 123, 6000).tolist()))
    (data / "odd.bin").write_bytes(b"abc")
    sweep = {
        "name": "fake", "program": str(FAKE), "method": "random",
        "metric": {"name": "val/accuracy", "goal": "maximize"},
        "parameters": {"learning_rate": {"distribution": "uniform", "min": 0.1, "max": 0.9}},
        "command": ["${env}", "${interpreter}", "${program}", "${args}"],
    }
    (data / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    invalid = dict(sweep, parameters={"learning_rate": {"distribution": "loguniform", "min": 0.1, "max": 0.9}})
    (data / "invalid_sweep.yaml").write_text(yaml.safe_dump(invalid))
    missing_config = dict(sweep, command=["${env}", "accelerate", "launch", "--config_file",
                                          "accelerate_configs/no_such_config.yaml", "${program}", "${args}"])
    (data / "missing_config_sweep.yaml").write_text(yaml.safe_dump(missing_config))


def command(program: str, args: list[str]) -> list[str]:
    if program == "search":
        return [sys.executable, "-m", "search", *args]
    return [sys.executable, str(IMAGE if program == "image" else LM), *args]


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def battery(tmp_path_factory):
    """Finished runs of both templates and a one-trial study, then every case against its own copy of them."""
    root = tmp_path_factory.mktemp("bad_input")
    data, existing = root / "data", root / "existing"
    write_data(data)
    prepare = [
        command("image", [*TINY_IMAGE, "--output_dir", str(existing / "image_run")]),
        command("lm", [*TINY_LM, "--data_path", str(data / "corpus.txt"), "--output_dir", str(existing / "lm_run")]),
        command("search", ["--sweep", str(data / "sweep.yaml"), "--n_trials", "1", "--output_dir", str(existing / "study")]),
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        for result in pool.map(run, prepare):
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert (existing / "lm_run" / "checkpoints" / "step_00000002").is_dir()

    def one(name: str):
        case = CASES[name]
        folder = root / "cases" / name.replace("/", "-")
        shutil.copytree(existing, folder, copy_function=shutil.copy2)
        places = {"image_run": folder / "image_run", "lm_run": folder / "lm_run", "study": folder / "study",
                  "data": data, "fresh": root / "fresh" / folder.name}  # a new run's folder, outside the snapshot
        fill = lambda text: text.format(**places)  # noqa: E731
        own = [fill(a) for a in case.args]
        if case.program == "search":
            args = [*own, "--output_dir", str(places["study"])]
        else:  # the case's own options come after the tiny defaults, so they win
            defaults = TINY_IMAGE if case.program == "image" else [*TINY_LM, "--data_path", str(data / "corpus.txt")]
            output = fill(case.output or ("{image_run}" if case.program == "image" else "{lm_run}"))
            args = [*defaults, *own, "--output_dir", output]
        before = snapshot(folder)
        result = run(command(case.program, args))
        return result, before, snapshot(folder), fill(case.expected), places

    names = sorted(CASES, key=lambda n: "corrupt" not in n)  # the slowest first
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(names, pool.map(one, names)))


def test_the_battery_has_at_least_20_cases_across_templates_configs_and_the_search_runner():
    kinds = {name.split("/")[0] for name in CASES}
    assert len(CASES) >= 20 and kinds == {"image", "lm", "config", "search"}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_error_line_and_changes_nothing_saved(battery, name):
    result, before, after, expected, places = battery[name]
    shown = f"exit {result.returncode}\n--- stdout ---\n{result.stdout[-2000:]}\n--- stderr ---\n{result.stderr[-3000:]}"
    assert result.returncode == 2, shown
    lines = [line for line in re.split(r"[\r\n]+", result.stderr) if line.strip() and not PROGRESS_BAR.match(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    assert expected in lines[0], (expected, lines[0])
    assert "Traceback" not in result.stdout + result.stderr, shown
    assert after == before, sorted(set(after.items()) ^ set(before.items()))[:5]
    fresh = places["fresh"]
    if fresh.exists():  # a new run that failed on its data: it published no checkpoint
        assert not (fresh / "checkpoints").exists() or not any((fresh / "checkpoints").iterdir())
