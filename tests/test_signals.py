"""Signals as they arrive in the wild: to the whole process group (a terminal's Ctrl-C, `kill -- -PGID`, `scancel`)
or to the launcher alone (`wandb agent`, a job script), at moments the fault suite does not choose. After each: the
run's end in status.json, no traceback, W&B's offline run holding every step logged before the signal, and no
process of the run left. Faults come from tests/fault_inject.py; scripts/stress_signals.py sends them at many
random moments (tests/test_stress_signals.py samples it)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.errors import read_status
from conftest import CONFIGS, REPO, clean_env, free_port, launch, wait_for_no_processes
from helpers import read_metrics, wandb_history_steps, write_tiny_corpus

sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_model import reverse_task  # noqa: E402

LM = REPO / "templates" / "language_model.py"
FINETUNE = REPO / "templates" / "finetune_causal_lm.py"
INJECT = REPO / "tests" / "fault_inject.py"
PROGRESS_BAR = re.compile(r"^train:\s+\d+%\|")
LM_ARGS = ("--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32", "--log_every_steps", "1",
           "--eval_every_steps", "5", "--eval_batches", "4", "--sample_tokens", "8", "--num_workers", "1",
           "--checkpoint_every_steps", "3", "--tracker", "wandb")


def launch_with_fault(tmp_path: Path, processes: int, fault: str, step: int, max_steps: int,
                      signal_name: str = "TERM") -> tuple[subprocess.CompletedProcess, Path]:
    """The language model under `accelerate launch -q`, in a session of its own (a terminal's process group), with
    FAULT sent by rank 0 just before optimizer step `step`."""
    output = tmp_path / "run"
    corpus = write_tiny_corpus(tmp_path / "corpus.txt")
    config = CONFIGS / ("cpu_ddp.yaml" if processes > 1 else "cpu.yaml")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "-q",
               "--main_process_port", str(free_port()), "--num_processes", str(processes), str(INJECT), str(LM),
               *LM_ARGS, "--data_path", str(corpus), "--max_steps", str(max_steps), "--output_dir", str(output)]
    env = clean_env(FAULT=fault, FAULT_STEP=str(step), FAULT_RANK="0", FAULT_SIGNAL=signal_name, CURVES_PNG="1")
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                            start_new_session=True)
    return result, output


def last_lines(text: str) -> list[str]:
    return [line for line in re.split(r"[\r\n]+", text) if line.strip() and not PROGRESS_BAR.match(line)]


def assert_clean_end(result: subprocess.CompletedProcess, output: Path) -> None:
    """No traceback, no C++ abort; W&B's offline run holds every step of metrics.jsonl; nothing of the run left."""
    for text in (result.stdout, result.stderr):
        assert "Traceback" not in text and "terminate called" not in text, text[-3000:]
    logged = {record["step"] for record in read_metrics(output)}
    held = wandb_history_steps(output)
    assert logged <= set(held), (sorted(logged - set(held)), len(held))
    assert wait_for_no_processes(str(output), timeout=10) == []


@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_to_the_process_group_at_the_last_evaluation_finishes_the_run(tmp_path, processes):
    """The signal comes with the last step: the run has trained to its end, so it finishes (an agreed stop at the last
    step is no stop). Before W&B's service was started apart, `accelerate launch` terminated it with the run, and the
    last evaluation's W&B call failed the run (45 lines ending in "ConnectionResetError: Connection lost", status.json
    failed, no curves.png) although its model had been exported."""
    result, output = launch_with_fault(tmp_path, processes, "signal_group", step=14, max_steps=14)
    # the launcher's exit code: 143 when it got the SIGTERM itself (torchrun's agent may see its ranks end first)
    assert result.returncode == 143 if processes == 1 else result.returncode in (0, 143), result.stderr[-3000:]
    record = read_status(output)
    assert (record["state"], record["step"], record["exit_code"], record["reason"]) == ("finished", 14, 0, ""), record
    assert (output / "model.safetensors").is_file() and (output / "curves.png").is_file()
    assert last_lines(result.stdout)[-1].startswith("W&B run saved offline; upload it with: wandb sync ")
    assert_clean_end(result, output)


def test_sigterm_to_the_launcher_alone_keeps_every_step_in_the_wandb_offline_run(tmp_path):
    """`wandb agent` or a job script stops the launcher alone; accelerate's launcher then terminates every process
    of the run. The run checkpoints and exits 75, and W&B's offline run holds every step logged before (its service
    was terminated with the run before: what it had not flushed in its last second was lost)."""
    result, output = launch_with_fault(tmp_path, 1, "signal_launcher", step=9, max_steps=400)
    assert result.returncode == 143, result.stderr[-3000:]
    record = read_status(output)
    assert (record["state"], record["exit_code"]) == ("preempted", 75), record
    assert last_lines(result.stderr)[-1] == (f"stopped at step {record['step']} by SIGTERM (preemption); "
                                             "checkpoint saved, continue with --resume auto")
    assert_clean_end(result, output)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_launcher_killed_stops_its_run_as_a_preemption(tmp_path, processes):
    """`kill -9` to `accelerate launch` (or the OOM killer choosing it): its ranks get a SIGTERM as it ends
    (PR_SET_PDEATHSIG) and stop as at a preemption: the step checkpointed, status.json `preempted`, nothing left, and
    `--resume auto` finishes. Before, one process trained on until its first write into the dead launcher's stderr
    pipe failed it ('[Errno 32] Broken pipe', status failed, no checkpoint of that step); two ranks trained on
    unwatched to their end."""
    result, output = launch_with_fault(tmp_path, processes, "signal_launcher", step=5, max_steps=40,
                                       signal_name="KILL")
    assert result.returncode == -9, result.stderr[-3000:]
    record = read_status(output)
    assert (record["state"], record["exit_code"]) == ("preempted", 75), record
    assert record["reason"] == "SIGTERM at the end of its launcher (preemption)" and record["step"] < 40, record
    assert (output / "checkpoints" / f"step_{record['step']:08d}").is_dir()
    if processes > 1:  # the ranks write to the launcher's own stdout and stderr, where the user reads
        assert last_lines(result.stderr)[-1] == (f"stopped at step {record['step']} by SIGTERM at the end of its "
                                                 "launcher (preemption); checkpoint saved, continue with --resume auto")
    assert_clean_end(result, output)
    resumed = launch("cpu_ddp.yaml" if processes > 1 else "cpu.yaml", LM, *LM_ARGS[:-2], "--tracker", "none",
                     "--data_path", str(tmp_path / "corpus.txt"), "--max_steps", "40", "--output_dir", str(output),
                     "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_status(output)["state"] == "finished"


@pytest.mark.parametrize("processes", [1, 2])
def test_a_ctrl_c_after_the_run_ended_ends_its_processes_without_a_traceback(tmp_path, processes):
    """Ctrl-C in the terminal once the run has ended (status.json `finished`), while its processes tear down (here
    as main() ends its loaders' workers, and again as the interpreter exits, each 2 s longer than usual): the teardown
    goes on to its end, with no traceback. Before, the KeyboardInterrupt struck inside it: "Exception ignored in:
    <function _MultiProcessingDataLoaderIter.__del__ ...>" and its traceback (stress_signals, lm-ddp)."""
    result, output = launch_with_fault(tmp_path, processes, "signal_at_exit", step=0, max_steps=6, signal_name="INT")
    # the launcher: 130 as it answers its own Ctrl-C; torchrun's agent may see its ranks end first
    assert result.returncode == 130 if processes == 1 else result.returncode in (0, 130), result.stderr[-3000:]
    record = read_status(output)
    assert (record["state"], record["step"], record["exit_code"]) == ("finished", 6, 0), record
    assert "Exception ignored" not in result.stderr + result.stdout, result.stderr[-3000:]
    assert_clean_end(result, output)


def test_a_launch_past_its_timeout_fails_with_the_stacks_of_its_processes_and_leaves_none(tmp_path):
    """The suite tells a hang from slowness: a run that passes its timeout fails its test with every process's stacks
    (py-spy where installed, else the templates' faulthandler on SIGUSR2), and all of them are killed."""
    output = tmp_path / "run"
    with pytest.raises(pytest.fail.Exception) as failed:
        launch("cpu.yaml", REPO / "templates" / "image_classification.py", "--epochs", "1000", "--width", "8",
               "--depth", "1", "--num_workers", "1", "--tracker", "none", "--output_dir", str(output), timeout=60)
    message = str(failed.value)
    assert "passed its 60 s timeout" in message and "image_classification.py" in message
    assert re.search(r"(Thread 0x|Current thread 0x|Thread \d+ )", message), message[-3000:]  # a stack, per thread
    assert wait_for_no_processes(str(output), timeout=10) == []


def test_a_test_that_leaves_a_process_behind_fails_the_session(tmp_path):
    """The session's end lists, kills and fails for every process a test left (tests/conftest.py)."""
    (tmp_path / "test_leaves_one.py").write_text(
        "import subprocess\n\n\ndef test_leaves_a_process(tmp_path):\n"
        "    subprocess.Popen(['sleep', '1000'])  # a child never waited for\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                             str(tmp_path / "test_leaves_one.py"), "--rootdir", str(tmp_path)],
                            cwd=tmp_path, env=clean_env(PYTHONPATH=f"{REPO / 'tests'}:{REPO}"), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 passed" in result.stdout and "processes left behind by the tests (killed now):" in result.stdout
    assert re.search(r"\d+: sleep 1000", result.stdout), result.stdout[-2000:]


@pytest.mark.parametrize("fault", ["signal_launcher", "signal_group"])
def test_a_stop_during_the_evaluation_before_training_ends_the_run_at_once(tmp_path, tiny_model, fault):
    """On one process, a stop before the session's first step (here during the fine-tuning template's evaluation
    before training, made 20 s long as a real model's is) ends the run at once: nothing was trained, so nothing to
    save. Before, the run waited for its first step to stop there, and accelerate's launcher SIGKILLed it 5 s after
    passing the SIGTERM on: status.json stayed `running`. Resumed, it trains to its end."""
    data = tmp_path / "reverse.jsonl"
    data.write_text("".join(json.dumps(example) + "\n" for example in reverse_task(200)))
    output = tmp_path / "run"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu.yaml"), "-q",
               "--main_process_port", str(free_port()), str(INJECT), str(FINETUNE), "--model",
               str(tiny_model), "--data_path", str(data), "--output_dir", str(output), "--max_steps", "6",
               "--batch_size", "4", "--tracker", "wandb"]
    env = clean_env(FAULT=fault, FAULT_STEP="0", FAULT_RANK="0", FAULT_SIGNAL="TERM", FAULT_SLOW_S="20")
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                            start_new_session=True)
    took = time.monotonic() - started
    assert result.returncode == 143, result.stderr[-3000:]
    record = read_status(output)
    assert (record["state"], record["step"], record["exit_code"]) == ("preempted", 0, 75), (record, took)
    stop_line = ("stopped before its first step by SIGTERM (preemption); nothing new to save, "
                 "continue with --resume auto")
    lines = last_lines(result.stderr)
    assert lines[-1] == stop_line, (lines[-10:], took)
    assert not list(output.glob("step_*")), "nothing trained, nothing saved"
    for text in (result.stdout, result.stderr):
        assert "Traceback" not in text and "terminate called" not in text, text[-3000:]
    assert wait_for_no_processes(str(output), timeout=10) == []

    resumed = launch("cpu.yaml", FINETUNE, "--model", str(tiny_model), "--data_path", str(data), "--output_dir",
                     str(output), "--max_steps", "6", "--batch_size", "4", "--tracker", "none", "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_status(output)["state"] == "finished"
