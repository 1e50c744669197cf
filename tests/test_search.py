"""The local search runner (search.runner), its trial runner (search.trial) and the multi-seed report (search.seeds).

Most tests run tests/fake_trial.py as the trial program (milliseconds, no torch); the end-to-end
search and seed runs use the image template through `accelerate launch`.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from conftest import (CONFIGS, REPO, clean_env, copy_template_alone, free_port, processes_mentioning,
                      wait_for_no_processes)
from helpers import is_png, read_metrics

from search import runner as search_module
from search import seeds as seeds_module
from search.runner import HISTORY_FILE, IMPORTANCES_FILE, SearchConfig, fail_stale_trials, make_pruner, make_sampler
from search.seeds import PICTURE_FILE, SeedsConfig, seed_band, summarize
from search.sweep import build_command, check_command_files, load_sweep, with_launch
from search.trial import run_trial

import optuna
from common.errors import UsageError

FAKE = REPO / "tests" / "fake_trial.py"
TEMPLATE = REPO / "templates" / "image_classification.py"
TINY_IMAGE = ["--epochs=3", "--width=8", "--depth=1", "--tracker=none"]


# ---------------------------------------------------------------------------------------- helpers
def write_sweep(tmp_path: Path, name: str = "fake", **config) -> Path:
    sweep = {
        "name": name,
        "program": str(FAKE),
        "method": "random",
        "metric": {"name": "val/accuracy", "goal": "maximize"},
        "parameters": {"learning_rate": {"distribution": "uniform", "min": 0.1, "max": 0.9}},
        "command": ["${env}", "${interpreter}", "${program}", "${args}"],
    }
    sweep.update(config)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return path


def cli(module: str, *args: str, timeout: float = 240, **popen) -> subprocess.CompletedProcess:
    popen = {"cwd": REPO, "env": clean_env(), **popen}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          **popen)


def start_cli(module: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def load_results(out: Path, study: str) -> dict:
    return json.loads((out / study / "results.json").read_text())


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


# -------------------------------------------------------------------------- sweep -> optuna mapping
def test_every_wandb_distribution_the_runner_accepts_samples_inside_its_range(tmp_path):
    params = {
        "const": {"value": 7},
        "choice": {"values": [16, 32]},
        "widths": {"values": [[64, 128], [256]]},
        "flag": {"values": [True, False]},
        "ints": {"min": 2, "max": 5},  # W&B infers int_uniform
        "floats": {"min": 0.0, "max": 0.5},  # and uniform
        "lr": {"distribution": "log_uniform_values", "min": 1.0e-5, "max": 1.0e-1},
        "inv": {"distribution": "inv_log_uniform_values", "min": 0.01, "max": 10.0},
        "qu": {"distribution": "q_uniform", "min": 0, "max": 256, "q": 32},
        "qlu": {"distribution": "q_log_uniform_values", "min": 8, "max": 512, "q": 8},
        "qlu_float": {"distribution": "q_log_uniform_values", "min": 0.01, "max": 1.0, "q": 0.01},
    }
    sweep = load_sweep(write_sweep(tmp_path, parameters=params))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = {name: set() for name in params}
    for _ in range(60):
        values = sweep.suggest(study.ask())
        assert list(values) == list(params)
        assert values["const"] == 7 and values["choice"] in (16, 32) and values["widths"] in ([64, 128], [256])
        assert values["flag"] in (True, False) and type(values["flag"]) is bool
        assert type(values["ints"]) is int and 2 <= values["ints"] <= 5
        assert 0.0 <= values["floats"] <= 0.5
        assert 1e-5 <= values["lr"] <= 1e-1
        assert 0.01 <= values["inv"] <= 10.0
        assert type(values["qu"]) is int and values["qu"] % 32 == 0 and 0 <= values["qu"] <= 256
        assert type(values["qlu"]) is int and values["qlu"] % 8 == 0 and 8 <= values["qlu"] <= 512
        steps = values["qlu_float"] / 0.01
        assert type(values["qlu_float"]) is float and abs(steps - round(steps)) < 1e-9
        for name, value in values.items():
            seen[name].add(json.dumps(value))
    assert all(len(v) > 1 for name, v in seen.items() if name != "const"), seen
    # log scale: about half the draws below the geometric middle
    draws = [t.params["lr"] for t in study.trials]
    assert 0.3 < sum(d < 1e-3 for d in draws) / len(draws) < 0.7


RANDOM = "method: random\nmetric: {name: a}\nparameters:\n"  # the head of most sweep files below


@pytest.mark.parametrize("text, expected", [
    (None, "not found"),
    ("method: [unclosed", "not valid YAML"),
    ("- just\n- a list\n", "expected a mapping"),
    (RANDOM + "  lr: {distribution: bogus, min: 1, max: 2}\n", "parameter lr: unknown distribution 'bogus'"),
    (RANDOM + "  lr: {distribution: normal, mu: 0.0, sigma: 1.0}\n", "parameter lr: normal cannot be searched locally"),
    (RANDOM + "  lr: {values: [1, 2], probabilities: [0.5, 0.5]}\n", "parameter lr: categorical_w_probabilities"),
    (RANDOM + "  opt: {parameters: {lr: {value: 1}}}\n", "parameter opt: nested parameters"),
    (RANDOM + "  lr: {distribution: log_uniform_values, min: 1e-4, max: 1.0e-2}\n",
     "parameter lr: min: '1e-4' is text to YAML"),
    (RANDOM + "  lr: {min: 0.5, max: 0.1}\n", "lr: min 0.5 is not less than max 0.1"),
    (RANDOM + "  lr: {distribution: log_uniform, min: -9.0, max: -2.0}\n", "lr uses log_uniform"),
    ("method: sometimes\nmetric: {name: a}\nparameters:\n  lr: {value: 1}\n", "'sometimes' is not one of"),
    ("method: random\nparameters:\n  lr: {value: 1}\n", "needs `metric:"),
    (RANDOM + "  lr: {value: 1}\ncommand: [python, train.py]\n", "command needs ${args}"),
    ("method: random\nmetric: {name: a}\nparameters:\n  output_dir: {value: x}\n", "parameter output_dir"),
])
def test_bad_sweep_file_is_one_error_line_and_exit_2(tmp_path, capsys, text, expected):
    path = tmp_path / "bad.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        search_module.main(["--sweep", str(path), "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    line = one_error_line(capsys.readouterr().err)
    assert expected in line and str(path) in line


@pytest.mark.parametrize("module, args, expected", [
    (search_module, ["--pruner", "sometimes"], "pruner must be one of"),
    (search_module, ["--n_trials", "0"], "n_trials must be at least 1"),
    (search_module, ["--", "--output_dir=x"], "--output_dir after `--`"),
    (search_module, ["--storage", "nosuchdb://x"], "--storage nosuchdb://x: cannot open it"),
    (seeds_module, ["--seeds", "1,1"], "seeds must differ"),
    (seeds_module, ["--results", "missing.json"], "--results missing.json: not found"),
    (search_module, ["--program", "missing.py"], "--program missing.py does not exist (relative to "),
    (search_module, ["--config_file", "missing.yaml"], "--config_file missing.yaml does not exist (relative to "),
    (search_module, ["--config_file", str(FAKE)], "starts no `accelerate launch`"),
    (seeds_module, ["--program", "missing.py"], "--program missing.py does not exist (relative to "),
])
def test_bad_runner_options_are_one_error_line_and_exit_2(tmp_path, capsys, module, args, expected):
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--sweep", str(write_sweep(tmp_path)), "--output_dir", str(tmp_path / "out"), *args])
    assert exit_info.value.code == 2
    assert expected in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("module, args, expected", [
    (search_module, ["--epochs", "9"], ("error: unknown option --epochs (options for the trials go after --: "
                                        "python -m search --sweep ... -- --epochs=9)")),
    (search_module, ["--epochs=9", "--tracker", "none", "--n_trials", "2"],
     ("error: unknown option --epochs (options for the trials go after --: "
      "python -m search --sweep ... -- --epochs=9 --tracker=none)")),
    (search_module, ["--n_trial", "3"], ("error: unknown option --n_trial (did you mean --n_trials?); options for the "
                                         "trials go after --: python -m search --sweep ... -- --n_trial=3")),
    (seeds_module, ["--epochs", "9"], ("error: unknown option --epochs (options for the trials go after --: "
                                       "python -m search.seeds ... -- --epochs=9)")),
])
def test_an_option_for_the_trials_before_the_separator_is_refused_with_the_separator_shown(tmp_path, capsys, module,
                                                                                             args, expected):
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--sweep", str(write_sweep(tmp_path)), "--output_dir", str(tmp_path / "out"), *args])
    assert exit_info.value.code == 2
    assert one_error_line(capsys.readouterr().err) == expected
    assert not (tmp_path / "out").exists()


def test_trial_runner_reads_the_file_the_tracker_writes():
    from common import tracking
    from search import trial

    assert trial.METRICS_FILE == tracking.METRICS_FILE


def test_hyperband_settings_map_to_optunas_pruner(tmp_path):
    cfg = SearchConfig(sweep="x")
    sweep = load_sweep(write_sweep(tmp_path, early_terminate={"type": "hyperband", "min_iter": 3, "eta": 2}))
    pruner, _ = make_pruner("auto", sweep, cfg)
    assert isinstance(pruner, optuna.pruners.HyperbandPruner)
    assert (pruner._min_resource, pruner._max_resource, pruner._reduction_factor) == (3, "auto", 2)
    sweep = load_sweep(write_sweep(tmp_path, early_terminate={"type": "hyperband", "max_iter": 27, "s": 2}))
    pruner, _ = make_pruner("auto", sweep, cfg)
    assert (pruner._min_resource, pruner._max_resource, pruner._reduction_factor) == (3, 27, 3)  # bands 3, 9 as W&B
    sweep = load_sweep(write_sweep(tmp_path))  # no early_terminate
    assert isinstance(make_pruner("auto", sweep, cfg)[0], optuna.pruners.MedianPruner)
    assert isinstance(make_pruner("none", sweep, cfg)[0], optuna.pruners.NopPruner)


def test_sampler_is_seeded_per_trial(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, parameters={"lr": {"distribution": "log_uniform_values", "min": 1.0e-5,
                                                                "max": 1.0}}))

    def draws(seed, kind):
        study = optuna.create_study(sampler=make_sampler(kind, sweep, seed))
        out = []
        for _ in range(4):
            trial = study.ask()
            out.append(sweep.suggest(trial)["lr"])
            study.tell(trial, out[-1])
        return out

    for kind in ("tpe", "random"):
        assert draws(0, kind) == draws(0, kind)  # one worker repeats itself
        assert draws(0, kind) != draws(1, kind)
        assert len(set(draws(0, kind))) == 4  # trial numbers differ, so draws differ (two workers never share a seed)


def test_trial_command_is_the_sweep_command_with_macros_filled(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, command=["${env}", "accelerate", "launch", "--config_file", "c.yaml",
                                                      "${program}", "${args}", "--x=1"]))
    argv = build_command(sweep, {"lr": 0.5, "aug": True, "w": [1, 2]}, ["--epochs=3"], "/out")
    assert argv[:3] == ["/usr/bin/env", "accelerate", "launch"] and argv[3].startswith("--main_process_port=")
    assert argv[4:] == ["--config_file", "c.yaml", str(FAKE), "--lr=0.5", "--aug=True", "--w=[1, 2]", "--epochs=3",
                        "--output_dir=/out", "--x=1"]


def test_program_and_config_file_replace_the_sweep_files_paths(tmp_path, monkeypatch):
    """--program and --config_file: a shipped sweep file runs a copied project's train.py with its own config."""
    monkeypatch.chdir(tmp_path)
    for name in ("train.py", "cpu.yaml"):
        (tmp_path / name).touch()
    for path in sorted((REPO / "sweeps").glob("*.yaml")):
        sweep = with_launch(load_sweep(path), "train.py", "cpu.yaml")
        check_command_files(sweep)  # relative to the working directory, as the trials see them
        argv = build_command(sweep, sweep.constants(), [], "out")
        at = argv.index("--config_file")
        assert argv[at:at + 3] == ["--config_file", "cpu.yaml", "train.py"], (path, argv)
    joined = load_sweep(write_sweep(tmp_path, command=["accelerate", "launch", "--config_file=a.yaml", "${program}",
                                                       "${args}"]))
    assert with_launch(joined, config_file="cpu.yaml").command[:3] == ["accelerate", "launch", "--config_file=cpu.yaml"]
    default = load_sweep(write_sweep(tmp_path, command=["accelerate", "launch", "${program}", "${args}"]))
    assert with_launch(default, config_file="cpu.yaml").command[:4] == ["accelerate", "launch", "--config_file",
                                                                          "cpu.yaml"]
    fixed = load_sweep(write_sweep(tmp_path, command=["python", "own.py", "${args}"]))
    with pytest.raises(UsageError, match=r"--program train.py: the command of sweep file .* has no \$\{program\}"):
        with_launch(fixed, program="train.py")


# ------------------------------------------------------------------------------------ trial runner
@pytest.mark.parametrize("ignore_term", [False, True], ids=["sigterm", "sigkill-after-grace"])
def test_stopped_trial_takes_its_whole_process_group_down(tmp_path, ignore_term):
    """The job and the child it started (a stand-in for a rank) get SIGTERM; SIGKILL follows after the grace period."""
    out = tmp_path / "trial"
    argv = [sys.executable, str(FAKE), f"--output_dir={out}", "--evals=100", "--sleep=0.2", "--child=true",
            f"--ignore_term={ignore_term}"]
    reports, asked = [], []

    def should_stop():
        asked.append(time.monotonic())
        return len(reports) >= 2

    grace = 1.5 if ignore_term else 5.0
    result = run_trial(argv, out, "val/accuracy", report=lambda i, step, v: reports.append((i, step, v)),
                       should_stop=should_stop, grace_s=grace, poll_s=0.05)
    stopping_took = time.monotonic() - asked[-1]
    assert result.state == "stopped"
    assert [r[:2] for r in reports] == [(1, 10), (2, 20)]
    if ignore_term:
        assert grace <= stopping_took < grace + 3
    else:
        assert stopping_took < 2.5  # all of the group went on SIGTERM, no wait for the grace period
    assert processes_mentioning(str(out)) == []  # the child ("rank") is gone too, at once


def test_failed_trial_reports_its_last_error_line(tmp_path):
    result = run_trial([sys.executable, str(FAKE), f"--output_dir={tmp_path / 'a'}", "--crash=out of cheese"],
                       tmp_path / "a", "val/accuracy", poll_s=0.05)
    # the trial's own error, not the launcher's
    assert result.state == "failed" and result.error == "exit 1: RuntimeError: out of cheese"
    result = run_trial([sys.executable, str(FAKE), f"--output_dir={tmp_path / 'b'}", "--fail=no such data"],
                       tmp_path / "b", "val/accuracy", poll_s=0.05)
    assert result.state == "failed" and result.error == "exit 2: error: no such data"
    result = run_trial([sys.executable, str(FAKE), f"--output_dir={tmp_path / 'c'}", "--metric=val/acc"],
                       tmp_path / "c", "val/accuracy", poll_s=0.05)
    assert result.state == "failed" and result.missing_metric and "val/acc" in result.logged_keys


def test_the_runs_own_end_state_decides_not_the_launchers_exit_code(tmp_path):
    """status.json, as the templates write it: a run that finished is complete even if the launcher then
    exits 1 (a process dying on its way out); a failure is named by the run's own line and code."""
    finished = [sys.executable, str(FAKE), f"--output_dir={tmp_path / 'a'}", "--status=finished", "--exit_code=1"]
    result = run_trial(finished, tmp_path / "a", "val/accuracy", poll_s=0.05)
    assert result.state == "complete" and result.value == pytest.approx(0.5), result
    failed = [sys.executable, str(FAKE), f"--output_dir={tmp_path / 'b'}", "--status=failed", "--fail=loss is NaN"]
    result = run_trial(failed, tmp_path / "b", "val/accuracy", poll_s=0.05)
    assert result.state == "failed" and result.error == "failed at step 10 (exit 3): loss is NaN", result
    crashed = [sys.executable, str(FAKE), f"--output_dir={tmp_path / 'c'}", "--status=running", "--crash=boom"]
    result = run_trial(crashed, tmp_path / "c", "val/accuracy", poll_s=0.05)
    assert result.state == "failed" and result.error == "crashed at step 0 (exit 1): RuntimeError: boom", result


def test_a_job_that_ended_by_itself_while_its_stop_was_decided_is_complete(tmp_path):
    """The job logs its last evaluation, goes on briefly (its final save) and exits 0 while the pruner answers."""
    out = tmp_path / "trial"
    argv = [sys.executable, str(FAKE), f"--output_dir={out}", "--values=0.9,0.8,0.7", "--sleep=0.05", "--linger=0.5"]
    reports = []

    def should_stop():
        if len(reports) < 3:
            return False
        time.sleep(2.0)  # the job, lingering 0.5 s after its last evaluation, has exited by now
        return True

    result = run_trial(argv, out, "val/accuracy", report=lambda i, step, v: reports.append(v), should_stop=should_stop,
                       poll_s=0.05)
    assert reports == [0.9, 0.8, 0.7]
    assert (result.state, result.returncode, result.value, result.error) == ("complete", 0, 0.7, None)


def seed_study(out: Path, study_name: str, *values: float) -> None:
    """A study in the runner's default journal holding one complete trial with these evaluations."""
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    (out / study_name).mkdir(parents=True)
    storage = JournalStorage(JournalFileBackend(str(out / study_name / "journal.log")))
    study = optuna.create_study(study_name=study_name, storage=storage, direction="maximize")
    study.add_trial(optuna.trial.create_trial(
        params={"learning_rate": 0.5},
        distributions={"learning_rate": optuna.distributions.FloatDistribution(0.1, 0.9)},
        value=values[-1], intermediate_values=dict(enumerate(values, start=1))))


def test_a_trial_that_reported_its_final_evaluation_is_complete_not_pruned(tmp_path):
    """Median pruning at every evaluation, a complete trial of 3: the new trial's 3rd is its last, so no pruning there.

    It stays running after the last evaluation (a final save), as a template does, so the pruner is asked while
    it runs; its best, 0.5, is below the median 0.9 at evaluation 3, where Optuna alone would prune it.
    """
    out = tmp_path / "out"
    seed_study(out, "fake", 0.1, 0.2, 0.9)
    sweep = write_sweep(tmp_path)
    done = cli("search", "--sweep", str(sweep), "--output_dir", str(out), "--n_trials", "2",
               "--pruner", "median", "--median_startup_trials", "1", "--min_evals", "1",
               "--", "--values=0.3,0.4,0.5", "--sleep=0.05", "--linger=2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trial 1: evaluation 3 (step 30): val/accuracy = 0.5" in done.stdout, done.stdout
    trial = load_results(out, "fake")["trials"][1]
    assert (trial["state"], trial["value"], trial["evals"]) == ("complete", 0.5, 3), done.stdout
    # A trial below the median before its last evaluation is still pruned (its best 0.25 < 0.3 at evaluation 2).
    done = cli("search", "--sweep", str(sweep), "--output_dir", str(out), "--n_trials", "3",
               "--pruner", "median", "--median_startup_trials", "1", "--min_evals", "1",
               "--", "--values=0.25,0.25,0.95", "--sleep=0.6")  # one evaluation per poll
    assert done.returncode == 0, done.stdout + done.stderr
    trial = load_results(out, "fake")["trials"][2]
    assert (trial["state"], trial["evals"]) == ("pruned", 2), done.stdout


def test_failed_trials_are_marked_failed_with_their_error(tmp_path):
    sweep = write_sweep(tmp_path, parameters={"crash": {"value": "boom at step 1"}})
    out = tmp_path / "out"
    done = cli("search", "--sweep", str(sweep), "--output_dir", str(out), "--n_trials", "5", "--max_failures", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "trial 0: failed, exit 1: RuntimeError: boom at step 1" in done.stdout
    results = load_results(out, "fake")
    assert results["counts"] == {"fail": 2}
    assert all(t["error"] == "exit 1: RuntimeError: boom at step 1" for t in results["trials"])


def test_metric_the_trial_never_logs_is_a_usage_error(tmp_path):
    sweep = write_sweep(tmp_path, metric={"name": "val/accuracy", "goal": "maximize"},
                        parameters={"metric": {"value": "val/acc"}})
    done = cli("search", "--sweep", str(sweep), "--output_dir", str(tmp_path / "out"), "--n_trials", "3")
    assert done.returncode == 2
    line = one_error_line(done.stderr)
    assert "trial 0 finished without logging metric 'val/accuracy'" in line and "val/acc" in line


def test_best_parameters_are_printed_and_stored_as_they_ran(tmp_path):
    """`--evals=2` after `--` replaces the sweep's evals (sampled 5 or 6): 2 ran, and 2 is what is shown and stored."""
    sweep = write_sweep(tmp_path, parameters={"learning_rate": {"min": 0.1, "max": 0.9}, "evals": {"values": [5, 6]}})
    out = tmp_path / "out"
    done = cli("search", "--sweep", str(sweep), "--output_dir", str(out), "--n_trials", "2",
               "--", "--evals=2", "--note", "two words")  # fake_trial ignores --note
    assert done.returncode == 0, done.stdout + done.stderr
    results = load_results(out, "fake")
    best = results["best"]
    assert best["evals"] == 2 and best["args"]["evals"] in (5, 6)  # what ran; what was sampled
    learning_rate = best["args"]["learning_rate"]
    assert best["effective_args"] == [f"--learning_rate={learning_rate}", "--evals=2", "--note", "two words"]
    assert best["argv"][-4:] == ["--evals=2", "--note", "two words", f"--output_dir={best['output_dir']}"]
    line = next(line for line in done.stdout.splitlines() if line.startswith("best parameters: "))
    assert line == f"best parameters: --learning_rate={best['args']['learning_rate']} --evals=2 --note 'two words'"
    assert f"(the options after -- replaced the sweep's --evals={best['args']['evals']})" in done.stdout
    shown = done.stdout.replace(f"replaced the sweep's --evals={best['args']['evals']}", "")
    assert "evals=5" not in shown and "evals=6" not in shown, done.stdout  # nor in the trial lines or the table
    assert "trial 0: learning_rate=" in done.stdout and " evals=2 -> " in done.stdout


def test_seeds_print_and_store_the_options_as_they_ran(tmp_path):
    sweep = write_sweep(tmp_path, parameters={"score": {"value": 0.5}, "evals": {"value": 5}})
    ran = cli("search.seeds", "--sweep", str(sweep), "--seeds", "0", "--output_dir", str(tmp_path / "s"),
              "--", "--evals=2")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "1 seeds of the sweep's constants: --score=0.5 --evals=2\n" in ran.stdout, ran.stdout
    assert "--evals=5" not in ran.stdout
    report = json.loads((tmp_path / "s" / "fake" / "seeds.json").read_text())
    assert report["effective_args"] == ["--score=0.5", "--evals=2"] and report["seeds"][0]["evals"] == 2


# ------------------------------------------------------------------------------------ a copied project
def copied_project(root: Path, program: Path) -> tuple[Path, dict[str, str]]:
    """`program` as train.py, common/ and search/ copied into an empty `root/app`, as README's "Use a template in
    your project" says, and an environment in which this repository's packages are not importable."""
    app, env = copy_template_alone("image_classification", root)
    (app / "image_classification.py").unlink()
    shutil.copy2(program, app / "train.py")
    shutil.copytree(REPO / "search", app / "search", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return app, env


def test_a_sweep_files_program_is_relative_to_where_the_search_runs(tmp_path):
    """The user's own sweep file, in a subfolder, names `program: train.py`: found from where `python -m search`
    runs (as under `wandb agent`). --program runs another script; search.seeds --results runs what the search ran."""
    app, env = copied_project(tmp_path, FAKE)
    (app / "sweeps").mkdir()
    write_sweep(app / "sweeps", name="mysweep", program="train.py")
    done = cli("search", "--sweep", "sweeps/mysweep.yaml", "--n_trials", "2", cwd=app, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((app / "runs/search/mysweep/results.json").read_text())
    assert results["program"] == "train.py" and results["counts"] == {"complete": 2}, results
    for trial in results["trials"]:
        assert trial["argv"][2] == "train.py" and read_metrics(app / trial["output_dir"])

    (app / "train_v2.py").write_text('print("this is train_v2.py")\n' + FAKE.read_text())
    done = cli("search", "--sweep", "sweeps/mysweep.yaml", "--program", "train_v2.py", "--study_name", "v2",
               "--n_trials", "1", cwd=app, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    trial = json.loads((app / "runs/search/v2/results.json").read_text())["trials"][0]
    assert trial["state"] == "complete"
    assert "this is train_v2.py" in (app / trial["output_dir"] / "trial.log").read_text()
    ran = cli("search.seeds", "--results", "runs/search/v2/results.json", "--seeds", "0", cwd=app, env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    seed = json.loads((app / "runs/seeds/v2/seeds.json").read_text())["seeds"][0]
    assert seed["state"] == "complete" and "this is train_v2.py" in (app / seed["output_dir"] / "trial.log").read_text()


def test_a_copied_project_searches_its_train_py_with_a_shipped_sweep_file(tmp_path):
    """README, "Use a template in your project": the template as train.py, common/, search/, an accelerate config
    and a shipped sweep file in an empty folder; there, --help shows the `--` form, `python -m search` runs that
    train.py through `accelerate launch` (two 1-epoch trials) and `search.seeds --results` reruns the best."""
    app, env = copied_project(tmp_path, TEMPLATE)
    shutil.copy2(CONFIGS / "cpu.yaml", app / "cpu.yaml")
    shutil.copy2(REPO / "sweeps" / "image_classification.yaml", app / "sweep.yaml")
    for module, usage in (
            ("search", "usage: python -m search --sweep FILE [--option=VALUE ...] [-- <template options>]"),
            ("search.seeds", "usage: python -m search.seeds (--results FILE | --sweep FILE) [--option=VALUE ...] "
                             "[-- <template options>]")):
        shown = cli(module, "--help", cwd=app, env=env)
        assert shown.returncode == 0 and shown.stdout.splitlines()[0] == usage, shown.stdout + shown.stderr
        assert "  --program str|none" in shown.stdout and "\n  -- <template options>\n" in shown.stdout

    done = cli("search", "--sweep", "sweep.yaml", "--program", "train.py", "--config_file", "cpu.yaml",
               "--n_trials", "2", "--", "--epochs=1", "--width=8", "--depth=1", "--tracker=none",
               cwd=app, env=env, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads((app / "runs/search/image_classification/results.json").read_text())
    assert results["counts"] == {"complete": 2}, done.stdout
    for trial in results["trials"]:
        at = trial["argv"].index("--config_file")
        assert trial["argv"][at:at + 3] == ["--config_file", "cpu.yaml", "train.py"]
        config = json.loads((app / trial["output_dir"] / "run.json").read_text())["config"]
        assert (config["epochs"], config["width"]) == (1, 8)
        assert config["learning_rate"] == trial["args"]["learning_rate"]

    ran = cli("search.seeds", "--results", "runs/search/image_classification/results.json", "--seeds", "0",
              cwd=app, env=env, timeout=300)  # the search's train.py and cpu.yaml, not the file's paths
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-4000:]
    seed = json.loads((app / "runs/seeds/image_classification/seeds.json").read_text())["seeds"][0]
    assert seed["value"] == results["best"]["value"]  # seed 0 is the trials' seed too: the best trial, repeated


# ------------------------------------------------------------------------------- end to end (real)
@pytest.fixture(scope="module")
def image_search(tmp_path_factory):
    """A 5-trial search over the image template's learning rate, 3 epochs each, hyperband from the file.

    min_iter 1, eta 3 and --max_resource 2 make one hyperband bracket whose rung is the first
    evaluation: a trial is pruned there unless it is the best so far (the top third from 3 trials on).
    The sampled learning rates depend only on the seeds; with seed 0 a poor one (chance accuracy)
    follows a good one, so at least one trial is pruned on any machine. The template runs paced
    (tests/paced_trial.py): each evaluation waits for the study's record of it, or a fast machine's
    trial would log all three within one poll of the runner and reach its end unasked.
    """
    tmp = tmp_path_factory.mktemp("image_search")
    sweep = write_sweep(
        tmp, name="tiny", program=str(TEMPLATE),
        parameters={
            "learning_rate": {"distribution": "log_uniform_values", "min": 1.0e-6, "max": 3.0e-2},
            "warmup_steps": {"value": 0},
            "batch_size": {"value": 128},
        },
        early_terminate={"type": "hyperband", "min_iter": 1, "eta": 3},
        command=["${env}", "accelerate", "launch", "--config_file", str(CONFIGS / "cpu.yaml"),
                 str(REPO / "tests" / "paced_trial.py"), "${program}", "${args}"],
    )
    out = tmp / "out"
    done = cli("search", "--sweep", str(sweep), "--output_dir", str(out), "--n_trials", "5", "--seed", "0",
               "--max_resource", "2", "--", *TINY_IMAGE, timeout=600,
               env=clean_env(PACE_JOURNAL=str(out / "tiny" / "journal.log")))
    return sweep, out, done


def test_search_finishes_prunes_and_leaves_no_process(image_search):
    sweep, out, done = image_search
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = load_results(out, "tiny")
    states = [t["state"] for t in results["trials"]]
    assert states.count("complete") + states.count("pruned") == 5 and "fail" not in states, done.stdout
    assert states.count("pruned") >= 1 and states.count("complete") >= 1, done.stdout
    dirs = [t["output_dir"] for t in results["trials"]]
    assert len(set(dirs)) == len(dirs)
    for trial in results["trials"]:
        logged = read_metrics(Path(trial["output_dir"]))
        accuracies = [r["val/accuracy"] for r in logged if "val/accuracy" in r]
        assert trial["evals"] <= len(accuracies) <= 3
        if trial["state"] == "complete":
            assert len(accuracies) == 3 and trial["value"] == accuracies[-1]
        config = json.loads((Path(trial["output_dir"]) / "run.json").read_text())["config"]
        assert config["learning_rate"] == trial["args"]["learning_rate"]
    best = max((t for t in results["trials"] if t["state"] == "complete"), key=lambda t: t["value"])
    assert results["best"]["number"] == best["number"] and results["best"]["params"] == best["args"]
    assert "best parameters: --learning_rate=" in done.stdout
    assert is_png(out / "tiny" / HISTORY_FILE) and f"pictures: {out / 'tiny' / HISTORY_FILE}\n" in done.stdout
    # learning_rate is the one parameter searched (the others are constants): all the importance is its own
    assert not (out / "tiny" / IMPORTANCES_FILE).exists()
    assert f"{IMPORTANCES_FILE} not drawn: parameter importances need 2 complete trials and 2 parameters" in done.stdout
    assert wait_for_no_processes(str(out)) == []


def test_seeds_rerun_the_best_trial_and_report_mean_and_sample_std(image_search, tmp_path):
    sweep, out, done = image_search
    assert done.returncode == 0
    seeds_out = tmp_path / "seeds"
    ran = cli("search.seeds", "--results", str(out / "tiny" / "results.json"), "--seeds", "0,1", "--output_dir",
              str(seeds_out), timeout=400)  # the trial's own options after -- (TINY_IMAGE) come with it
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-4000:]
    report = json.loads((seeds_out / "tiny" / "seeds.json").read_text())
    best = load_results(out, "tiny")["best"]
    assert report["params"] == best["params"] and report["extra_args"] == TINY_IMAGE == best["extra_args"]
    values = []
    for run in report["seeds"]:
        logged = read_metrics(Path(run["output_dir"]))
        assert run["value"] == [r["val/accuracy"] for r in logged if "val/accuracy" in r][-1]
        config = json.loads((Path(run["output_dir"]) / "run.json").read_text())["config"]
        assert config["seed"] == run["seed"] and (config["epochs"], config["width"]) == (3, 8)
        assert config["learning_rate"] == best["params"]["learning_rate"]
        values.append(run["value"])
    assert [run["seed"] for run in report["seeds"]] == [0, 1]
    assert report["mean"] == pytest.approx(statistics.fmean(values))
    assert report["std"] == pytest.approx(statistics.stdev(values))
    assert report["std_kind"] == "sample standard deviation (ddof=1)"
    assert is_png(seeds_out / "tiny" / PICTURE_FILE) and f"picture: {seeds_out / 'tiny' / PICTURE_FILE}" in ran.stdout
    assert wait_for_no_processes(str(seeds_out)) == []


def test_seeds_report_matches_known_values(tmp_path):
    """The fake program's value is score + seed/100, so the statistics are known in advance."""
    sweep = write_sweep(tmp_path, parameters={"score": {"value": 0.5}, "evals": {"value": 2}})
    ran = cli("search.seeds", "--sweep", str(sweep), "--seeds", "0,1,2,5", "--output_dir", str(tmp_path / "s"))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    report = json.loads((tmp_path / "s" / "fake" / "seeds.json").read_text())
    assert [(r["seed"], r["value"]) for r in report["seeds"]] == [(0, 0.5), (1, 0.51), (2, 0.52), (5, 0.55)]
    assert report["n"] == 4
    assert report["mean"] == pytest.approx(0.52)
    assert report["std"] == pytest.approx(0.0216024689946929)  # numpy.std([0.5, 0.51, 0.52, 0.55], ddof=1)
    assert "0.52 ± 0.0216 (mean ± sample std, ddof=1, over 4 seeds)" in ran.stdout
    assert summarize([1.0]) == {"n": 1, "mean": 1.0, "std": None, "std_kind": "sample standard deviation (ddof=1)"}


# ------------------------------------------------------------------------------------- pictures
def study_of(params: list[str], trials: int):
    """An in-memory study whose value is the sum of its parameters, each drawn from [0, 1]."""
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(trials):
        trial = study.ask()
        study.tell(trial, sum(trial.suggest_float(name, 0.0, 1.0) for name in params))
    return study


def test_the_search_draws_its_history_and_the_importances_of_the_parameters_that_vary(tmp_path, capsys):
    import matplotlib

    style = dict(matplotlib.rcParams)
    written = search_module.draw_study(study_of(["learning_rate", "weight_decay"], 4), tmp_path, "val/accuracy")
    assert written == [tmp_path / HISTORY_FILE, tmp_path / IMPORTANCES_FILE] and all(map(is_png, written))
    # Optuna's ggplot style stays in its pictures: the program's next picture (a run's curves.png) is drawn as before
    assert {k: v for k, v in matplotlib.rcParams.items() if style.get(k) != v and k != "backend"} == {}
    assert capsys.readouterr().out == f"pictures: {tmp_path / HISTORY_FILE}, {tmp_path / IMPORTANCES_FILE}\n"
    for params, trials, why in ((["learning_rate"], 4, "here 4 complete, varying: learning_rate"),
                                (["learning_rate", "weight_decay"], 1, "here 1 complete, varying: none")):
        folder = tmp_path / f"{len(params)}_{trials}"
        folder.mkdir()
        assert search_module.draw_study(study_of(params, trials), folder, "val/accuracy") == [folder / HISTORY_FILE]
        assert is_png(folder / HISTORY_FILE) and not (folder / IMPORTANCES_FILE).exists()
        assert capsys.readouterr().out.splitlines() == [
            f"{IMPORTANCES_FILE} not drawn: parameter importances need 2 complete trials and 2 parameters that vary "
            f"among them ({why})", f"pictures: {folder / HISTORY_FILE}"]


@pytest.fixture
def drawn(monkeypatch) -> dict:
    """The figures the search tools save, by file name, as they were when saved (Optuna's are closed after)."""
    import common.curves

    figures, save = {}, common.curves.save_figure

    def recording(figure, path):
        figure.canvas.draw()  # ticks and texts as in the file
        figures[Path(path).name] = {"texts": [t.get_text() for t in figure.texts],
                                    "suptitle": figure._suptitle.get_text() if figure._suptitle else "",
                                    "xticks": [list(ax.get_xticks()) for ax in figure.axes]}
        save(figure, path)

    monkeypatch.setattr(common.curves, "save_figure", recording)
    return figures


def test_the_search_pictures_count_trials_in_whole_numbers_and_say_how_few_the_importances_come_from(tmp_path,
                                                                                                   drawn):
    search_module.draw_study(study_of(["learning_rate", "weight_decay"], 4), tmp_path, "val/accuracy")
    history, importances = drawn[HISTORY_FILE], drawn[IMPORTANCES_FILE]
    trials = history["xticks"][0]
    assert trials and all(tick == int(tick) for tick in trials), trials  # no trial 0.5
    assert "from 4 complete trials: importances from so few trials are noise" in importances["texts"]
    (tmp_path / "many").mkdir()
    search_module.draw_study(study_of(["learning_rate", "weight_decay"], 25), tmp_path / "many", "val/accuracy")
    assert "from 25 complete trials" in drawn[IMPORTANCES_FILE]["texts"]


def test_seeds_png_names_the_trial_and_the_settings_it_repeats(tmp_path, drawn):
    sweep = write_sweep(tmp_path, parameters={"score": {"value": 0.5}, "evals": {"value": 2}, "sleep": {"value": 0}})
    seeds_module.run_seeds(SeedsConfig(sweep=str(sweep), seeds=[0, 1], output_dir=str(tmp_path / "s")), [])
    title = " ".join(drawn[PICTURE_FILE]["suptitle"].split())
    assert title.startswith("the sweep's constants: ") and "--score=0.5" in title and "--evals=2" in title, title
    figure = seeds_module.draw_seeds({0: [(1, 0.5)], 1: [(1, 0.6)]}, [0, 1], "val/accuracy", tmp_path / "t.png",
                                     about="trial 7 of runs/search/x/results.json: --learning_rate=0.01")
    assert figure._suptitle.get_text() == "trial 7 of runs/search/x/results.json: --learning_rate=0.01"


def test_without_matplotlib_the_search_and_the_seeds_say_so_in_one_line_and_end_as_before(tmp_path, monkeypatch,
                                                                                           capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert search_module.draw_study(study_of(["a", "b"], 3), tmp_path, "val/accuracy") == []
    assert capsys.readouterr().out == "the search's pictures not drawn: matplotlib is not installed (pip install " \
                                      "matplotlib)\n"
    sweep = write_sweep(tmp_path, parameters={"score": {"value": 0.5}, "evals": {"value": 2}, "sleep": {"value": 0}})
    cfg = SeedsConfig(sweep=str(sweep), seeds=[0, 1], output_dir=str(tmp_path / "s"))
    report = seeds_module.run_seeds(cfg, [])
    assert [run["value"] for run in report["seeds"]] == [0.5, 0.51]
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [f"report: {tmp_path / 's' / 'fake' / 'seeds.json'}",
                        f"{PICTURE_FILE} not drawn: matplotlib is not installed (pip install matplotlib)"]
    assert sorted(p.name for p in (tmp_path / "s" / "fake").iterdir()) == ["seed_0", "seed_1", "seeds.json"]


def test_seed_pictures_show_each_seed_and_the_mean_and_std_where_every_complete_seed_evaluated(tmp_path):
    curves = {0: [(10, 0.5), (20, 0.7), (30, 0.8)], 1: [(10, 0.6), (20, 0.9)], 2: [(10, 0.1)]}  # seed 2 failed
    steps, mean, std = seed_band(curves, complete=[0, 1])
    assert steps == [10, 20] and mean == pytest.approx([0.55, 0.8]) and std == pytest.approx([0.0707107, 0.1414214])
    assert seed_band(curves, complete=[0]) == ([], [], [])  # one seed: no spread to show
    figure = seeds_module.draw_seeds(curves, [0, 1], "val/accuracy", tmp_path / PICTURE_FILE)
    assert is_png(tmp_path / PICTURE_FILE)
    (ax,) = figure.axes
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert lines["seed 0"] == ([10, 20, 30], [0.5, 0.7, 0.8]) and lines["seed 2 (failed)"] == ([10], [0.1])
    assert lines["mean of 2 seeds"][0] == [10, 20] and lines["mean of 2 seeds"][1] == pytest.approx([0.55, 0.8])
    (band,) = ax.collections  # the ± std band
    assert band.get_paths()[0].get_extents().y0 == pytest.approx(0.55 - 0.0707107)


# ----------------------------------------------------------------------- workers, storage, restarts
def check_shared_study(storage, study_name: str, ledger: Path, n_trials: int, workers: int) -> None:
    study = optuna.load_study(study_name=study_name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    finished = [t for t in trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
    assert n_trials <= len(finished) <= n_trials + workers - 1
    assert all(t.state != optuna.trial.TrialState.RUNNING for t in trials)
    numbers = [t.number for t in trials]
    assert sorted(numbers) == list(range(len(trials)))
    ran = ledger.read_text().splitlines()
    assert len(ran) == len(set(ran)) == len(trials)  # every trial ran exactly once
    assert sorted(ran) == sorted(t.user_attrs["output_dir"] for t in trials)
    assert len({t.user_attrs["worker"]["pid"] for t in trials}) == workers  # both took part


def run_workers(sweep: Path, out: Path, n_trials: int, *extra: str, workers: int = 2) -> list[str]:
    procs = [start_cli("search", "--sweep", str(sweep), "--output_dir", str(out), "--n_trials", str(n_trials),
                       "--seed", str(i), *extra) for i in range(workers)]
    logs = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, stdout
        logs.append(stdout)
    return logs


def test_two_workers_share_a_journal_without_running_a_trial_twice(tmp_path):
    ledger = tmp_path / "ledger"
    sweep = write_sweep(tmp_path, parameters={"learning_rate": {"min": 0.1, "max": 0.9},
                                              "ledger": {"value": str(ledger)}, "sleep": {"value": 0.15}})
    out = tmp_path / "out"
    run_workers(sweep, out, 8)
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    check_shared_study(JournalStorage(JournalFileBackend(str(out / "fake" / "journal.log"))), "fake", ledger, 8, 2)


def test_the_worker_that_finishes_last_leaves_the_final_results(tmp_path):
    """A worker that ends while another's trial runs says so; the other, ending last, writes the final results.json."""
    go = tmp_path / "go"
    sweep = write_sweep(tmp_path)
    out = tmp_path / "out"
    slow = start_cli("search", "--sweep", str(sweep), "--output_dir", str(out), "--n_trials", "2",
                     "--", "--evals=1", f"--wait_for={go}")
    try:
        deadline = time.monotonic() + 60
        while not (out / "fake" / "trial_0000" / "metrics.jsonl").is_file():
            assert time.monotonic() < deadline and slow.poll() is None, slow.stdout.read()
            time.sleep(0.1)
        fast = cli("search", "--sweep", str(sweep), "--output_dir", str(out), "--n_trials", "2", "--seed", "1",
                   "--", "--evals=1")
        assert fast.returncode == 0, fast.stdout + fast.stderr
        assert "1 trial(s) still running in other workers (0): these results are not final" in fast.stdout, fast.stdout
        results = load_results(out, "fake")
        assert results["final"] is False and results["counts"] == {"running": 1, "complete": 1}
    finally:
        go.touch()
    stdout, _ = slow.communicate(timeout=60)
    assert slow.returncode == 0, stdout
    assert "still running" not in stdout
    results = load_results(out, "fake")
    assert results["final"] is True and results["counts"] == {"complete": 2}
    assert [t["state"] for t in results["trials"]] == ["complete", "complete"]


def test_results_writers_take_turns_so_the_last_write_holds_the_latest_state(tmp_path, monkeypatch):
    """Worker A reads the storage, then is slow to write; meanwhile B's trial ends and B writes. A must not go last."""
    import threading

    sweep = load_sweep(write_sweep(tmp_path))
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), study_name="race", direction="maximize")
    done_trial = study.ask()
    study.tell(done_trial, 0.5)
    running = study.ask()
    a_has_read, b_wrote = threading.Event(), threading.Event()
    record = search_module.trial_record

    def slow_record(trial):  # called once A has read the trials
        if threading.current_thread().name == "A":
            a_has_read.set()
            b_wrote.wait(timeout=2)  # without turns B writes meanwhile; with them it waits, and this times out
        return record(trial)

    monkeypatch.setattr(search_module, "trial_record", slow_record)
    worker_a = threading.Thread(name="A", target=search_module.write_results, args=(study, sweep, tmp_path, "mem", 2))
    worker_a.start()
    assert a_has_read.wait(timeout=10)
    study.tell(running, 0.7)  # B's trial ends

    def worker_b():
        search_module.write_results(study, sweep, tmp_path, "mem", 2)
        b_wrote.set()

    thread_b = threading.Thread(name="B", target=worker_b)
    thread_b.start()
    worker_a.join(timeout=30)
    thread_b.join(timeout=30)
    results = json.loads((tmp_path / "results.json").read_text())
    assert [t["state"] for t in results["trials"]] == ["complete", "complete"]
    assert results["final"] is True and results["best"]["number"] == running.number


def test_grid_search_runs_each_point_once_and_stops(tmp_path):
    ledger = tmp_path / "ledger"
    sweep = write_sweep(tmp_path, method="grid", parameters={"learning_rate": {"values": [0.2, 0.4, 0.6]},
                                                             "evals": {"min": 1, "max": 2},
                                                             "ledger": {"value": str(ledger)}})
    done = cli("search", "--sweep", str(sweep), "--output_dir", str(tmp_path / "out"), "--n_trials", "10")
    assert done.returncode == 0, done.stdout + done.stderr
    trials = load_results(tmp_path / "out", "fake")["trials"]
    assert sorted((t["args"]["learning_rate"], t["args"]["evals"]) for t in trials) == [
        (0.2, 1), (0.2, 2), (0.4, 1), (0.4, 2), (0.6, 1), (0.6, 2)]
    assert len(ledger.read_text().splitlines()) == 6


def test_restarted_study_continues_and_fails_the_trial_its_killed_worker_left(tmp_path):
    ledger = tmp_path / "ledger"
    sweep = write_sweep(tmp_path, parameters={"learning_rate": {"min": 0.1, "max": 0.9},
                                              "ledger": {"value": str(ledger)}})
    out = tmp_path / "out"
    worker = start_cli("search", "--sweep", str(sweep), "--output_dir", str(out), "--n_trials", "3",
                       "--", "--evals=100", "--sleep=0.2")
    deadline = time.monotonic() + 60
    while not (out / "fake" / "trial_0000" / "metrics.jsonl").is_file():
        assert time.monotonic() < deadline and worker.poll() is None, worker.stdout.read()
        time.sleep(0.1)
    worker.kill()  # SIGKILL: no chance to clean up or mark anything
    worker.wait()
    assert wait_for_no_processes(str(out), timeout=5) == []  # its trial died with it

    done = cli("search", "--sweep", str(sweep), "--output_dir", str(out), "--n_trials", "3", "--", "--evals=2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"trial 0: marked failed, its worker (pid {worker.pid} on" in done.stdout
    results = load_results(out, "fake")
    assert [t["state"] for t in results["trials"]] == ["fail", "complete", "complete", "complete"]
    assert results["trials"][0]["error"].startswith("abandoned: its worker")
    # Started again when done: nothing left to do, no new trial.
    again = cli("search", "--sweep", str(sweep), "--output_dir", str(out), "--n_trials", "3")
    assert again.returncode == 0 and len(load_results(out, "fake")["trials"]) == 4


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_stopped_worker_stops_its_trial_and_marks_it_failed(tmp_path, signum):
    sweep = write_sweep(tmp_path)
    out = tmp_path / "out"
    worker = start_cli("search", "--sweep", str(sweep), "--output_dir", str(out), "--",
                       "--evals=100", "--sleep=0.2", "--child=true")
    deadline = time.monotonic() + 60
    while not processes_mentioning(f"fake-rank-of {out}"):
        assert time.monotonic() < deadline and worker.poll() is None, worker.stdout.read()
        time.sleep(0.1)
    worker.send_signal(signum)
    stdout, _ = worker.communicate(timeout=60)
    assert worker.returncode == 130, stdout
    by = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert f"error: interrupted by {by}; run the same command to continue the study" in stdout
    assert wait_for_no_processes(str(out), timeout=5) == []
    trial = load_results(out, "fake")["trials"][0]
    assert trial["state"] == "fail" and trial["error"] == "interrupted: its worker was stopped"


def test_running_trial_without_heartbeat_is_failed_only_when_stale(tmp_path):
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    live, dead, old = study.ask(), study.ask(), study.ask()
    live.set_user_attr("worker", {"host": "elsewhere", "pid": 1})
    live.set_user_attr("heartbeat", time.time())
    dead.set_user_attr("worker", {"host": "here", "pid": 2**22 + 12345})  # no such pid
    dead.set_user_attr("heartbeat", time.time())
    old.set_user_attr("worker", {"host": "elsewhere", "pid": 1})
    old.set_user_attr("heartbeat", time.time() - 1000)
    assert fail_stale_trials(study, stale_after_s=180, host="here") == [dead.number, old.number]
    assert [t.state.name for t in study.trials] == ["RUNNING", "FAIL", "FAIL"]


# --------------------------------------------------------------------------------------- postgres
def postgres_bin_dir() -> Path | None:
    candidates = [os.environ.get("PG_BIN"), os.path.dirname(shutil.which("initdb") or "")]
    installed = Path("/usr/lib/postgresql").glob("*/bin")
    candidates += sorted((str(p) for p in installed), key=lambda p: int(Path(p).parent.name))[::-1]
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").is_file() and (Path(candidate) / "pg_ctl").is_file():
            return Path(candidate)
    return None


def skip_or_fail(reason: str):
    if os.environ.get("SEARCH_TESTS_REQUIRE_POSTGRES") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def postgres_url():
    """A throwaway PostgreSQL server on a free port (run as the `postgres` user when we are root)."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        skip_or_fail("PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql, or set PG_BIN")
    try:
        import psycopg  # noqa: F401  the driver SQLAlchemy 2.1 uses for postgresql:// URLs
    except ImportError:
        skip_or_fail("no PostgreSQL driver: pip install 'psycopg[binary]'")
    run_as: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="search-pg-"))
    if os.geteuid() == 0:  # postgres refuses to run as root
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            skip_or_fail("running as root and there is no 'postgres' user to run the server as")
        shutil.chown(base, "postgres")
        run_as = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    data = base / "data"
    try:
        subprocess.run([*run_as, str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
                        "-E", "UTF8", "--no-sync"], check=True, capture_output=True, text=True, timeout=120)
        subprocess.run([*run_as, str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(base / "server.log"),
                        "-w", "-t", "60", "-o", f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off",
                        "start"], check=True, capture_output=True, text=True, timeout=120)
    except subprocess.CalledProcessError as error:
        log = (base / "server.log").read_text() if (base / "server.log").is_file() else ""
        shutil.rmtree(base, ignore_errors=True)
        pytest.fail(f"PostgreSQL did not start: {error.stderr or error.stdout}{log[-2000:]}")
    yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    subprocess.run([*run_as, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                   capture_output=True, timeout=60)
    shutil.rmtree(base, ignore_errors=True)


def test_two_workers_share_a_postgresql_study(tmp_path, postgres_url):
    ledger = tmp_path / "ledger"
    sweep = write_sweep(tmp_path, parameters={"learning_rate": {"min": 0.1, "max": 0.9},
                                              "ledger": {"value": str(ledger)}, "sleep": {"value": 0.15}})
    run_workers(sweep, tmp_path / "out", 6, "--storage", postgres_url, "--study_name", "pg")
    check_shared_study(postgres_url, "pg", ledger, 6, 2)
    assert not (tmp_path / "out" / "pg" / "journal.log").exists()
    results = load_results(tmp_path / "out", "pg")
    assert results["storage"] == postgres_url  # no password in this URL to hide
