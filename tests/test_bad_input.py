"""The bad-input battery: wrong flags, values, data, checkpoints, folders, config and sweep files.

Every case runs the real program directly (`python templates/<x>.py ...` or `python -m search ...`)
and must end with exactly one `error:` line naming the problem, a non-zero exit (2), no traceback,
and nothing already saved changed: each case points at its own copy of finished runs of both
templates and of a search study, whose every file (path, size, mtime, sha256) is compared before
and after. Cases run two at a time; some repeat checks made elsewhere, as the battery is the
README's figure.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import subprocess
import sys
import textwrap
import time
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import (
    CTRL_C_LINE,
    REPO,
    accelerate_launch_command,
    clean_env,
    interrupt_like_ctrl_c,
    launch,
    load_template,
)
from helpers import snapshot, wandb_history_steps

from common.errors import read_status

IMAGE = REPO / "templates" / "image_classification.py"
LM = REPO / "templates" / "language_model.py"
FAKE = REPO / "tests" / "fake_trial.py"
TINY_IMAGE = ["--epochs", "1", "--width", "8", "--depth", "1", "--batch_size", "512", "--tracker", "none"]
TINY_LM = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--batch_size", "8",
           "--max_steps", "2", "--eval_every_steps", "0", "--eval_batches", "1", "--sample_tokens", "0",
           "--tracker", "none"]
PROGRESS_BAR = re.compile(r"^train:\s+\d+%\|")


@dataclass(frozen=True)
class Case:
    program: str  # image, lm or search
    args: tuple[str, ...]  # {image_run}, {lm_run}, {study}, {data}, {fresh} are filled in
    expected: str  # part of the one error line
    # --output_dir (templates): the copy of a finished run it may not change; default by program
    output: str | None = None


def lm_checkpoint() -> str:
    return "{lm_run}/checkpoints/step_00000002"


NOT_WRITABLE = "/proc/1"  # a folder even root cannot write in (os.access says so too)
HUGE = str(2**40)  # channels: a first layer of terabytes, which no allocator grants


CASES = {
    # -- image template: flags and values
    "image/unknown-flag": Case("image", ("--epoch", "3"), "unknown option --epoch (did you mean --epochs?)"),
    "image/wrong-type": Case("image", ("--epochs=abc",), "--epochs: expected an integer, got 'abc'"),
    "image/negative-learning-rate": Case("image", ("--learning_rate", "-1e-3"),
                                         "learning_rate must be > 0, got -0.001"),
    "image/batch-size-0": Case("image", ("--batch_size", "0"), "batch_size must be at least 1, got 0"),
    "image/accumulation-0": Case("image", ("--gradient_accumulation_steps", "0"),
                                 "gradient_accumulation_steps must be at least 1, got 0"),
    "image/dropout-out-of-range": Case("image", ("--dropout", "1.5"), "dropout must be in [0, 1), got 1.5"),
    "image/label-smoothing-2": Case("image", ("--label_smoothing", "2"), "label_smoothing must be in [0, 1), got 2.0"),
    "image/learning-rate-inf": Case("image", ("--learning_rate", "inf"),
                                    "learning_rate must be a finite number, got inf"),
    "image/num-workers-below-minus-1": Case("image", ("--num_workers", "-2"),
                                            "num_workers must be at least -1, got -2"),
    "image/image-size-huge": Case("image", ("--data_dir", "{data}/few_images", "--image_size", "100000"),
                                  "image_size must be at most 1024, got 100000"),
    "image/unknown-tracker": Case("image", ("--tracker", "tensorboard,bogus"),
                                  "tracker must be one or several (comma-separated) of wandb, tensorboard, mlflow, "
                                  "trackio, or none; got 'tensorboard,bogus'"),
    "image/invalid-wandb-project": Case("image", ("--tracker", "wandb", "--wandb_project", "team/project"),
                                       "wandb_project 'team/project': W&B takes 1 to 128 characters, none of"),
    "image/model-too-big-for-memory": Case("image", ("--width", HUGE), "out of memory allocating "),
    # -- image template: data
    "image/missing-data-dir": Case("image", ("--data_dir", "{data}/no_such_folder"), "no_such_folder: no such folder"),
    "image/empty-data-dir": Case("image", ("--data_dir", "{data}/empty"), "need at least 2 class folders"),
    "image/data-dir-is-a-file": Case("image", ("--data_dir", "{data}/corpus.txt"),
                                     "--data_dir {data}/corpus.txt is a file, not a folder of class folders"),
    "image/too-few-images-for-a-batch": Case("image", ("--data_dir", "{data}/few_images", "--image_size", "8",
                                                       "--batch_size", "64"),
                                             "11 training images make no full batch of 64 per process (1 process): "
                                             "use --batch_size 11 or less"),
    "image/corrupt-image": Case("image", ("--data_dir", "{data}/images", "--image_size", "16", "--batch_size", "8",
                                          "--num_workers", "0"), "cannot read image {data}/images/", output="{fresh}"),
    "image/corrupt-image-in-a-worker": Case("image", ("--data_dir", "{data}/images", "--image_size", "16",
                                                      "--batch_size", "8", "--num_workers", "2"),
                                            "cannot read image {data}/images/", output="{fresh}"),
    # -- image template: checkpoints and output folders
    # Another shape is other settings: refused before the checkpoint is even opened (test_checkpoint.py
    # covers a model changed in the code, whose message names the mismatched keys and shapes).
    "image/checkpoint-of-another-shape": Case("image", ("--width", "16"),
                                              "belongs to a run with other settings: --width 8 there, 16 now"),
    "image/unsafe-checkpoint": Case("image", ("--resume", "{data}/tampered_image"),
                                    "refused optimizer.bin: it holds more than plain data, loading it could run code "
                                    "(Unsupported global: GLOBAL argparse.Namespace"),
    "image/checkpoint-of-another-template": Case("image", ("--resume", lm_checkpoint()),
                                                 "was written by template 'language_model', "
                                                 "not 'image_classification'"),
    "image/resume-path-missing": Case("image", ("--resume", "{data}/no_such_checkpoint"),
                                      "no_such_checkpoint: no such checkpoint or run folder"),
    "image/folder-of-another-run": Case("image", ("--resume", "none"), "already holds checkpoints of a run (newest: "),
    "image/folder-of-another-template": Case("image", (),
                                             "holds a run of template 'language_model'; choose another --output_dir",
                                             output="{lm_run}"),
    "image/output-dir-is-a-file": Case("image", (), "--output_dir {image_run}/metrics.jsonl is a file, not a folder",
                                       output="{image_run}/metrics.jsonl"),
    "image/output-dir-under-a-file": Case("image", (), "--output_dir {image_run}/model.safetensors/run cannot be "
                                          "created: {image_run}/model.safetensors is a file, not a folder",
                                          output="{image_run}/model.safetensors/run"),
    "image/output-dir-not-writable": Case("image", (), f"--output_dir {NOT_WRITABLE}: this folder is not writable",
                                          output=NOT_WRITABLE),
    # -- config files
    "config/missing": Case("image", ("--config", "{data}/missing.yaml"), "missing.yaml: not found"),
    "config/not-yaml": Case("image", ("--config", "{data}/broken.yaml"), "broken.yaml: not valid YAML"),
    "config/wrong-type": Case("image", ("--config", "{data}/wrong_type.yaml"),
                              "wrong_type.yaml: label_smoothing: expected a number, got 'lots'"),
    "config/unknown-key": Case("lm", ("--config", "{data}/unknown_key.yaml"),
                               "unknown_key.yaml: unknown key 'max_step' (did you mean max_steps?)"),
    # -- language-model template
    "lm/not-a-multiple-of-heads": Case("lm", ("--n_embd", "30", "--n_head", "4"),
                                       "n_embd (30) must be a multiple of n_head (4)"),
    "lm/max-steps-0": Case("lm", ("--max_steps", "0"), "max_steps must be at least 1, got 0"),
    "lm/missing-corpus": Case("lm", ("--data_path", "{data}/no_such_corpus.txt"),
                              "no_such_corpus.txt: no such file or folder"),
    "lm/empty-corpus": Case("lm", ("--data_path", "{data}/empty.txt"), "empty corpus, no bytes to train on"),
    "lm/corpus-too-short-for-a-batch": Case("lm", ("--data_path", "{data}/short.txt", "--val_fraction", "0.5"),
                                            "4 training windows make no full batch of 8 per process (1 process): "
                                            "use --batch_size 4 or less"),
    "lm/odd-token-file": Case("lm", ("--data_path", "{data}/odd.bin"), "has 3 bytes, not a multiple of 2"),
    "lm/unreadable-corpus": Case("lm", ("--data_path", "/proc/1/mem"), "cannot read /proc/1/mem ("),  # even for root
    "lm/init-from-a-folder": Case("lm", ("--init_from", "{data}"), "--init_from {data}: no model.safetensors in this "
                                                                     "folder (a run writes it when it finishes)"),
    "lm/checkpoint-of-another-shape": Case("lm", ("--data_path", "{data}/corpus.txt", "--n_embd", "64"),
                                           "belongs to a run with other settings: --n_embd 32 there, 64 now"),
    "lm/unsafe-checkpoint": Case("lm", ("--resume", "{data}/tampered_lm"),
                                 "refused random_states_0.pkl: it holds more than plain data, loading it could run "
                                 "code (Unsupported global: GLOBAL argparse.Namespace"),
    "lm/learning-rate-inf": Case("lm", ("--learning_rate", "inf"), "learning_rate must be a finite number, got inf"),
    "lm/dropout-nan": Case("lm", ("--dropout", "nan"), "dropout must be in [0, 1), got nan"),
    "lm/temperature-0": Case("lm", ("--temperature", "0"), "temperature must be >= 0.001, got 0.0"),
    "lm/vocab-size-beyond-uint16": Case("lm", ("--vocab_size", "100000"),
                                        "vocab_size must be at most 65536, got 100000"),
    "lm/num-workers-below-minus-1": Case("lm", ("--num_workers", "-2"), "num_workers must be at least -1, got -2"),
    "lm/unknown-tracker": Case("lm", ("--tracker", "none,wandb"),
                               "tracker must be one or several (comma-separated) of wandb, tensorboard, mlflow, "
                               "trackio, or none; got 'none,wandb'"),
    "lm/model-too-big-for-memory": Case("lm", ("--n_embd", HUGE, "--n_head", "1"), "out of memory allocating "),
    "lm/output-dir-not-writable": Case("lm", (), f"--output_dir {NOT_WRITABLE}/run cannot be created: {NOT_WRITABLE} "
                                       "is not writable", output=f"{NOT_WRITABLE}/run"),
    "lm/output-dir-is-a-file": Case("lm", (), "--output_dir {lm_run}/run.json is a file, not a folder",
                                    output="{lm_run}/run.json"),
    # -- the search runner
    "search/unknown-flag": Case("search", ("--sweep", "{data}/sweep.yaml", "--n_trial", "3"),
                                "unknown option --n_trial (did you mean --n_trials?)"),
    "search/n-trials-0": Case("search", ("--sweep", "{data}/sweep.yaml", "--n_trials", "0"),
                              "n_trials must be at least 1"),
    "search/missing-sweep": Case("search", ("--sweep", "{data}/no_such_sweep.yaml"), "no_such_sweep.yaml: not found"),
    "search/invalid-sweep": Case("search", ("--sweep", "{data}/invalid_sweep.yaml"),
                                 "parameter learning_rate: unknown distribution 'loguniform'"),
    "search/missing-accelerate-config": Case("search", ("--sweep", "{data}/missing_config_sweep.yaml"),
                                             "the command's --config_file accelerate_configs/no_such_config.yaml "
                                             "does not exist"),
    "search/missing-program": Case("search", ("--sweep", "{data}/sweep.yaml", "--program", "no_such_train.py"),
                                   "--program no_such_train.py does not exist"),
}


def write_data(data: Path) -> None:
    from PIL import Image

    (data / "empty").mkdir()
    for c, name in enumerate(("red", "green", "blue")):
        (data / "images" / name).mkdir(parents=True)
        for i in range(8):
            color = [40, 40, 40]
            color[c] = 100 + 15 * i
            Image.new("RGB", (20, 20), tuple(color)).save(data / "images" / name / f"{i}.png")
    # corrupt, in one split or the other
    (data / "images" / "green" / "broken.png").write_bytes(b"these bytes are no PNG")
    for c, name in enumerate(("red", "green", "blue")):  # 15 good images, 11 of them to train on
        (data / "few_images" / name).mkdir(parents=True)
        for i in range(5):
            color = tuple(60 + 60 * (k == c) + 10 * i for k in range(3))
            Image.new("RGB", (8, 8), color).save(data / "few_images" / name / f"{i}.png")
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


def tampered_copy(checkpoint: Path, copy: Path, victim: str) -> None:
    """A copy of `checkpoint` whose `victim` pickle also holds an object outside torch's weights-only allowlist
    (harmless here; torch's refusal of it advises loading with weights_only=False, which must not be passed on)."""
    import argparse

    import torch

    shutil.copytree(checkpoint, copy)
    original = torch.load(checkpoint / victim, weights_only=False)  # our own file: safe to load fully here
    torch.save({"original": original, "extra": argparse.Namespace(note="not plain data")}, copy / victim)


def command(program: str, args: list[str]) -> list[str]:
    if program == "search":
        return [sys.executable, "-m", "search", *args]
    return [sys.executable, str(IMAGE if program == "image" else LM), *args]


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("bad_input_data")
    write_data(data)
    return data


@pytest.fixture(scope="module")
def battery(tmp_path_factory, data):
    """Finished runs of both templates and a one-trial study, then every case against its own copy of them."""
    root = tmp_path_factory.mktemp("bad_input")
    existing = root / "existing"
    prepare = [
        command("image", [*TINY_IMAGE, "--output_dir", str(existing / "image_run")]),
        command("lm", [*TINY_LM, "--data_path", str(data / "corpus.txt"), "--output_dir", str(existing / "lm_run")]),
        command("search", ["--sweep", str(data / "sweep.yaml"), "--n_trials", "1",
                           "--output_dir", str(existing / "study")]),
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        for result in pool.map(run, prepare):
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert (existing / "lm_run" / "checkpoints" / "step_00000002").is_dir()
    image_checkpoint = max((existing / "image_run" / "checkpoints").glob("step_*"))
    tampered_copy(image_checkpoint, data / "tampered_image", "optimizer.bin")
    tampered_copy(existing / "lm_run" / "checkpoints" / "step_00000002", data / "tampered_lm", "random_states_0.pkl")

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
    shown = (f"exit {result.returncode}\n--- stdout ---\n{result.stdout[-2000:]}\n"
             f"--- stderr ---\n{result.stderr[-3000:]}")
    assert result.returncode == 2, shown
    lines = [line for line in re.split(r"[\r\n]+", result.stderr) if line.strip() and not PROGRESS_BAR.match(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    assert expected in lines[0], (expected, lines[0])
    assert "weights_only" not in lines[0]  # torch's advice to load a refused file unsafely is not passed on
    assert "Traceback" not in result.stdout + result.stderr, shown
    assert after == before, sorted(set(after.items()) ^ set(before.items()))[:5]
    fresh = places["fresh"]
    if fresh.exists():  # a new run that failed on its data: it published no checkpoint
        assert not (fresh / "checkpoints").exists() or not any((fresh / "checkpoints").iterdir())


# --------------------------------------------------------------------------- beyond the battery
def error_lines(stderr: str) -> list[str]:
    return [line for line in re.split(r"[\r\n]+", stderr) if line.strip() and not PROGRESS_BAR.match(line)]


def tiny(program: str, data: Path) -> list[str]:
    return TINY_IMAGE if program == "image" else [*TINY_LM, "--data_path", str(data / "corpus.txt")]


def out_of_range(low_open: bool, low: float, high: float, high_open: bool, is_int: bool) -> list[float]:
    """Values just outside an interval (and, for floats, inf and NaN, which no range admits)."""
    values = [] if is_int else [math.inf, -math.inf, math.nan]
    if math.isfinite(low):
        values.append(low if low_open else (low - 1 if is_int else math.nextafter(low, -math.inf)))
    if math.isfinite(high):
        values.append(high if high_open else (high + 1 if is_int else math.nextafter(high, math.inf)))
    return [int(v) if is_int else v for v in values]


def test_every_option_of_both_templates_has_a_range_checked_alike_and_shown_by_help(capsys):
    from common.config import _interval, format_help

    configs = {name: load_template(name).Config for name in ("image_classification", "language_model")}
    for name, config in configs.items():
        for f in dataclasses.fields(config):
            kind = typing.get_type_hints(config)[f.name]
            allowed = f.metadata.get("range")
            if kind in (int, float):
                assert isinstance(allowed, str), f"{name}: --{f.name} has no range"
                low_open, low, high, high_open = _interval(allowed)
                for end in (low, high):  # a closed end is allowed (n_embd 1 still needs n_head 1)
                    if math.isfinite(end) and (end == low and not low_open or end == high and not high_open):
                        config(**{f.name: kind(end)}, **({"n_head": 1} if f.name == "n_embd" else {}))
                for bad in out_of_range(low_open, low, high, high_open, kind is int):
                    with pytest.raises(ValueError, match=f"^{f.name} must be "):
                        config(**{f.name: bad})
            elif isinstance(allowed, tuple):  # strings with choices
                with pytest.raises(ValueError, match=f"^{f.name} must be one of "):
                    config(**{f.name: "bogus"})
            if allowed is not None:
                shown = f"one of {', '.join(allowed)}" if isinstance(allowed, tuple) else f"range {allowed}"
                assert f"--{f.name} " in format_help(config) and shown in format_help(config).split(f"--{f.name} ")[1]
    image, lm = ({f.name: f.metadata.get("range") for f in dataclasses.fields(c)} for c in configs.values())
    assert {k: v for k, v in image.items() if k in lm} == {k: v for k, v in lm.items() if k in image}  # the same way


@pytest.mark.parametrize("program", ["image", "lm", "search"])
def test_help_into_a_reader_that_stopped_early_exits_quietly(program):
    """`python templates/x.py --help | head`: head may be gone before the help is written."""
    child = subprocess.Popen(command(program, ["--help"]), cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    child.stdout.close()  # before the template has even imported torch: its help meets a closed pipe
    stderr = child.stderr.read()
    assert child.wait(timeout=120) == 0 and stderr == "", stderr


@pytest.mark.parametrize("program", ["image", "lm"])
def test_ctrl_c_is_one_line_and_exit_130(program, data, tmp_path):
    longer = ["--epochs", "1000"] if program == "image" else ["--max_steps", "100000"]

    def in_the_loop(child):
        for line in child.stdout:  # printed just before the training loop starts
            if "optimizer steps" in line:
                break
        time.sleep(1)

    code, stderr = interrupt_like_ctrl_c(
        command(program, [*tiny(program, data), *longer, "--output_dir", str(tmp_path / "run")]), in_the_loop)
    assert code == 130, stderr[-3000:]
    assert error_lines(stderr) == [CTRL_C_LINE], stderr[-3000:]
    # status.json says so too (a job script reads it: the launcher's exit code is no guide), not `running`
    record = read_status(tmp_path / "run")
    assert (record["state"], record["exit_code"]) == ("failed", 130), record
    assert "error: " + record["error"] == CTRL_C_LINE, record


def test_ctrl_c_under_accelerate_launch_keeps_the_wandb_history_and_ends_with_the_one_line(tmp_path):
    """A terminal's Ctrl-C reaches the launcher too, and `accelerate launch` then terminates every process the
    run started, W&B's service included: what W&B recorded until a second before the interrupt is in its offline
    file (flushed every second), and stderr still ends with the one line."""
    out = tmp_path / "run"
    args = ["--epochs", "1000", "--width", "8", "--depth", "1", "--num_workers", "0", "--log_every_steps", "1",
            "--tracker", "wandb", "--output_dir", str(out)]
    logged: set[int] = set()

    def ten_steps_logged(child):
        nonlocal logged
        deadline = time.monotonic() + 120
        while len(logged) < 10 and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.2)
            if (out / "metrics.jsonl").is_file():
                logged = {json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()}
        assert len(logged) >= 10, "the run logged nothing"
        time.sleep(4)  # the steps in `logged` are now more than a flush interval old

    code, stderr = interrupt_like_ctrl_c(accelerate_launch_command("cpu.yaml", IMAGE, *args), ten_steps_logged)
    assert code == 130, stderr[-3000:]
    assert error_lines(stderr) == [CTRL_C_LINE], stderr[-3000:]
    steps = wandb_history_steps(out)
    assert logged <= set(steps), (sorted(logged - set(steps))[:5], len(steps))
    assert steps == sorted(set(steps))  # no step twice


@pytest.mark.parametrize("program, batch_size, warning", [
    ("image", 4, ("warning: full batches of --batch_size 4 on 1 process take 8 of the 11 training images, "
                  "leaving 3 (27%) out of every epoch; a smaller --batch_size leaves fewer out")),
    ("image", 1, None),
    ("lm", 3, ("warning: full batches of --batch_size 3 on 1 process take 3 of the 4 training windows, "
               "leaving 1 (25%) out of every epoch; a smaller --batch_size leaves fewer out")),
    ("lm", 2, None),
])
def test_whole_batches_leaving_much_of_a_small_training_set_out_get_one_warning(program, batch_size, warning, data,
                                                                                 tmp_path):
    small = (["--data_dir", str(data / "few_images"), "--image_size", "8"] if program == "image"
             else ["--data_path", str(data / "short.txt"), "--val_fraction", "0.5"])
    result = run(command(program, [*tiny(program, data), *small, "--batch_size", str(batch_size),
                                   "--output_dir", str(tmp_path / "run")]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if "warning" in line] == ([warning] if warning else [])


@pytest.mark.parametrize("program", ["image", "lm"])
def test_on_two_ranks_a_training_set_without_a_full_batch_names_the_batch_size_that_fits(program, data, tmp_path):
    small = (["--data_dir", str(data / "few_images"), "--image_size", "8", "--batch_size", "8"] if program == "image"
             else ["--data_path", str(data / "short.txt"), "--val_fraction", "0.5", "--batch_size", "4"])
    expected = ("11 training images make no full batch of 8 per process (2 processes): use --batch_size 5 or less"
                if program == "image" else
                "4 training windows make no full batch of 4 per process (2 processes): use --batch_size 2 or less")
    launched = launch("cpu_ddp.yaml", IMAGE if program == "image" else LM, *tiny(program, data), *small,
                      "--output_dir", str(tmp_path / "run"), launcher_args=("-q",))
    assert launched.returncode == 1, launched.stderr[-3000:]  # accelerate launch's own code for any failure
    errors = [line for line in error_lines(launched.stderr) if line.startswith("error:")]
    assert errors == [f"error: {expected}"], launched.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_accelerate_launch_q_leaves_only_the_line_on_one_process_and_torchrun_adds_a_summary_on_two():
    """What README, "Errors and exit codes", says of `accelerate launch -q`."""
    line = "error: --epochs: expected an integer, got 'abc'"
    one = launch("cpu.yaml", IMAGE, "--epochs=abc", launcher_args=("-q",))
    assert (one.returncode, one.stdout, error_lines(one.stderr)) == (1, "", [line]), one.stderr
    two = launch("cpu_ddp.yaml", IMAGE, "--epochs=abc", launcher_args=("-q",))
    lines = error_lines(two.stderr)
    assert two.returncode == 1 and lines[0] == line and line not in lines[1:], two.stderr
    assert "templates/image_classification.py FAILED" in two.stderr and 12 <= len(lines) <= 40, two.stderr


@pytest.mark.parametrize("program", ["image", "lm"])
def test_non_finite_gradients_before_any_checkpoint_say_there_is_none(program, data, tmp_path):
    """A finite but absurd learning rate: refused only when it blows up, and then without promising a checkpoint."""
    result = run(command(program, [*tiny(program, data), "--learning_rate", "1e30", "--warmup_steps", "0",
                                   "--output_dir", str(tmp_path / "run")]))
    assert result.returncode == 3, result.stderr[-3000:]
    assert re.fullmatch(r"error: non-finite gradients at step \d+ \(loss \S+\); no checkpoint was saved yet",
                        error_lines(result.stderr)[-1]), result.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


SLOW_RANK_0_SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    from common.errors import UsageError, with_exit_codes

    @with_exit_codes
    def main():
        if os.environ["LOCAL_RANK"] == "0":
            time.sleep(3)  # rank 0 a moment behind, as on a busy machine: rank 1 meets the error first
        raise UsageError("--epochs: expected an integer, got 'abc'")

    main()
""")


def test_the_one_line_is_printed_when_the_silent_rank_meets_the_error_first(tmp_path):
    """Every rank raises the same error and only local rank 0 prints it: had the silent rank exited first, the
    launcher's SIGTERM would end rank 0 before its line is out, and the user would read no `error:` line."""
    script = tmp_path / "slow_rank_0.py"
    script.write_text(SLOW_RANK_0_SCRIPT.format(repo=str(REPO)))
    two = launch("cpu_ddp.yaml", script, launcher_args=("-q",), timeout=120)
    lines = error_lines(two.stderr)
    assert two.returncode == 1 and lines[0] == "error: --epochs: expected an integer, got 'abc'", two.stderr
    assert sum(line.startswith("error:") for line in lines) == 1, two.stderr
