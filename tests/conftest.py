"""Shared test helpers: the repo on sys.path, `accelerate launch` runs, a clean accelerate state, templates
loaded as modules, and the fixtures. The small readers and writers of files are in helpers.py."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import write_tiny_corpus

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from search.sweep import free_port  # noqa: E402  (the one copy; search/ imports no torch)

CONFIGS = REPO / "accelerate_configs"
# No curves.png at the end of the suite's hundreds of runs (about half a second each); the tests of the picture
# set CURVES_PNG=1 (tests/test_tracking.py, the image template's documented outputs and its stop and resume).
os.environ["CURVES_PNG"] = "0"
# The Ctrl-C tests send SIGINT as a terminal does. A suite started in the background by a shell without job control
# (`cmd &` in a script, nohup) inherits SIGINT ignored, and so would every process it starts: handled here, it is
# back to its default in them (exec resets handled signals, not ignored ones).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a launched run: offline, no credentials, no rank variables leaking in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "ACCELERATE_", "FSDP_"))}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def launch(
    config: str,
    script: str | Path,
    *args: str,
    num_processes: int | None = None,
    timeout: float = 300,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    launcher_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run `accelerate launch --config_file accelerate_configs/<config> script args` to completion."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
               "--main_process_port", str(free_port()), *launcher_args]
    if num_processes is not None:
        command += ["--num_processes", str(num_processes)]
    command += [str(script), *args]
    return run_to_end(command, cwd=cwd or REPO, env=env or clean_env(), timeout=timeout)


def run_to_end(command: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True)` in a session of its own; past `timeout` the test
    fails with the stacks of every process of the run, which are then killed (`communicate_or_show_stacks`)."""
    child = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    stdout, stderr = communicate_or_show_stacks(child, timeout)
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


def communicate_or_show_stacks(child: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """`child.communicate(timeout)`; a run that passes its timeout fails the test with the stacks of every process of
    it (a hang shows where it waits; slowness shows busy stacks), after which they are all killed. The stacks come
    from py-spy where it is installed, else from the templates' faulthandler (SIGUSR2, common.accelerator.start_run)
    on their stderr. `child` must lead a session of its own (start_new_session=True): its processes are found so,
    also those orphaned on the way."""
    try:
        return child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    processes = run_processes(child.pid)
    stacks = []
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    for pid, command in processes:
        dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60) \
            if spy else None
        if dump is not None and dump.returncode == 0:
            stacks.append(f"--- {pid}: {command}\n{dump.stdout}")
        elif "python" in command and "accelerate" not in command:  # py-spy missing or not allowed to trace
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR2)  # faulthandler in a template's processes (the launcher has none)
    time.sleep(1)
    for pid, _ in processes:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    try:
        stdout, stderr = child.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        stdout, stderr = "", "(its output pipes stayed open)"
    processes_text = "\n".join(f"{pid}: {command}" for pid, command in processes)
    pytest.fail(f"the run passed its {timeout} s timeout; its processes:\n{processes_text}\n{''.join(stacks)}"
                f"\nstdout tail:\n{stdout[-3000:]}\nstderr tail (with the stacks faulthandler printed where py-spy "
                f"is not installed):\n{stderr[-20000:]}", pytrace=False)


def _proc_stat(pid: str) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name: state, ppid, pgrp, session, ..."""
    return (Path("/proc") / pid / "stat").read_text().rsplit(")", 1)[1].split()


def run_processes(leader: int) -> list[tuple[int, str]]:
    """The live processes of the session `leader` leads, and their descendants: (pid, command line)."""
    found: dict[int, str] = {}
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid, _, session = _proc_stat(entry.name)[:4]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        except (OSError, IndexError, ValueError):
            continue
        if state in ("Z", "X"):
            continue
        parents[int(entry.name)] = int(ppid)
        if int(session) == leader or int(entry.name) == leader:
            found[int(entry.name)] = command
    changed = True
    while changed:  # descendants in sessions of their own (W&B's service where W&B starts it)
        changed = False
        for pid, ppid in parents.items():
            if ppid in found and pid not in found:
                with contextlib.suppress(OSError):
                    found[pid] = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                        errors="replace")[:200]
                    changed = True
    return sorted(found.items())


CTRL_C_LINE = "error: interrupted by Ctrl-C; the checkpoints saved before are intact: continue with --resume auto"


def interrupt_like_ctrl_c(cmd: list[str], ready) -> tuple[int, str]:
    """Start `cmd` in a process group of its own (a terminal's foreground group), wait until `ready(child)` says
    it is time, send SIGINT to the whole group as a terminal's Ctrl-C does; the exit code and stderr."""
    child = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        ready(child)
        os.killpg(child.pid, signal.SIGINT)
        _, stderr = communicate_or_show_stacks(child, 120)
    finally:
        child.kill()
    return child.returncode, stderr


def accelerate_launch_command(config: str, script: str | Path, *args: str) -> list[str]:
    """`accelerate launch --config_file accelerate_configs/<config> script args` as a user types it: the
    `accelerate` program of this interpreter's environment, which a terminal's Ctrl-C reaches too."""
    program = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    return [program, "launch", "--config_file", str(CONFIGS / config), str(script), *args]


def processes_mentioning(marker: str) -> list[str]:
    """Live processes (not zombies) whose command line contains `marker`, as 'pid: cmdline'."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state not in ("Z", "X"):
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def wait_for_no_processes(marker: str, timeout: float = 20) -> list[str]:
    """The processes still mentioning `marker` after up to `timeout` s. Loader workers of a killed
    process notice within 5 s (torch's watchdog interval) that it is gone."""
    deadline = time.monotonic() + timeout
    while (left := processes_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def descendants(pid: int) -> list[str]:
    """The live descendants of process `pid`, as 'pid: cmdline'."""
    parents, commands = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                state, ppid = _proc_stat(entry.name)[:2]
                if state not in ("Z", "X"):
                    parents[int(entry.name)] = int(ppid)
                    commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                        errors="replace")[:200]
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return [f"{child}: {commands[child]}" for child in sorted(found)]


def pytest_sessionfinish(session, exitstatus):
    """No test leaves a process behind: after the tests, every process started under this session's temporary folder
    (the runs' output folders are there; loader workers carry their rank's command line) and every descendant of this
    process must be gone within 20 s (W&B's service ends 5 s after its run), else they are listed, killed, and the
    session fails. The controller of `pytest -n` leaves its workers' descendants to them."""
    marker = str(session.config._tmp_path_factory.getbasetemp())
    controller = os.environ.get("PYTEST_XDIST_WORKER") is None and bool(getattr(session.config.option, "numprocesses",
                                                                                 None))
    deadline = time.monotonic() + 20
    while True:
        # W&B's service, where a test's own wandb.init started it as a child, serves this process to its exit
        children = [line for line in ([] if controller else descendants(os.getpid())) if "wandb-core" not in line]
        left = sorted(set(processes_mentioning(marker)) | set(children))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if left:
        for line in left:
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        text = "processes left behind by the tests (killed now):\n" + "\n".join(left)
        if reporter is not None:
            reporter.write_line(text, red=True)
        else:
            print(text, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def copy_template_alone(name: str, root: Path) -> tuple[Path, dict[str, str]]:
    """templates/<name>.py and common/ copied into an empty `root/app`, as the README tells users to,
    and an environment in which the repository's own common/ is not importable."""
    app = root / "app"
    app.mkdir()
    shutil.copy2(REPO / "templates" / f"{name}.py", app / f"{name}.py")
    shutil.copytree(REPO / "common", app / "common", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = clean_env()
    env.pop("PYTHONPATH", None)
    probe = subprocess.run([sys.executable, "-c", "import common"], cwd=root, env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr  # the runs use the copy
    return app, env


def copy_into_monorepo(name: str, root: Path, shadow: str) -> tuple[Path, dict[str, str]]:
    """templates/<name>.py as `train.py` and common/ copied into `root/parent/proj`, a project inside a
    repository whose `root/parent` has a `common` of its own: a module (shadow="module") or a package
    without accelerator.py ("package"), also on PYTHONPATH. Returns the project folder and the environment."""
    parent = root / "parent"
    proj = parent / "proj"
    proj.mkdir(parents=True)
    shutil.copy2(REPO / "templates" / f"{name}.py", proj / "train.py")
    shutil.copytree(REPO / "common", proj / "common", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if shadow == "module":
        (parent / "common.py").write_text("OWNER = 'the monorepo'\n")
    else:
        (parent / "common").mkdir()
        (parent / "common" / "__init__.py").write_text("OWNER = 'the monorepo'\n")
        (parent / "common" / "strings.py").write_text("def shout(text):\n    return text.upper()\n")
    env = clean_env(PYTHONPATH=str(parent))  # the monorepo's root on the path, as such repositories often set
    probe = subprocess.run([sys.executable, "-c", "import common; print(common.OWNER)"], cwd=parent, env=env,
                           capture_output=True, text=True, check=False)
    assert probe.stdout.strip() == "the monorepo", probe.stderr  # what a plain `import common` finds there
    return proj, env


def load_template(name: str):
    """Import templates/<name>.py as a module (registered in sys.modules, as dataclasses need)."""
    module_name = f"template_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, REPO / "templates" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The tiny corpus, written once for a test module."""
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus") / "tiny.txt")


@pytest.fixture
def repo() -> Path:
    return REPO


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide singletons (AcceleratorState with PartialState, GradientState):
    the next Accelerator built in this process is a new job's, not the first one's settings again."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def start_clean_accelerate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `monkeypatch` (which restores them): no accelerate, FSDP, rank or WANDB_MODE variables,
    one CPU thread; then a clean accelerate state."""
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))] + [
        "ACCELERATE_USE_CPU", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "WANDB_MODE",
    ]:
        monkeypatch.setenv(key, "")  # records the original value (or its absence) for the restore ...
        monkeypatch.delenv(key)  # ... then the test starts without it
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    reset_accelerate_state()


@pytest.fixture
def fresh_accelerate(monkeypatch):
    """A clean slate for building an `Accelerator` (or running a template's `main`) in the test process.

    accelerate keeps process-wide singletons (the first Accelerator's settings would stick), and
    `build_accelerator` writes ACCELERATE_USE_CPU into os.environ; both are reset after the test.
    """
    start_clean_accelerate(monkeypatch)
    yield
    reset_accelerate_state()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny Llama-architecture model and tokenizer, written once per session by scripts/make_tiny_model.py."""
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_tiny_model(tmp_path_factory.mktemp("tiny_model") / "tiny")


# --- host syncs ----------------------------------------------------------------------------------
HOST_SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


def host_syncs_per_step(monkeypatch, libraries: tuple[str, ...] = ()) -> list[dict]:
    """Record every read of a tensor's value on the host while a template trains in-process, per optimizer
    step: a list of windows ({"syncs": [...], "busy": bool}), each closed by AdamW.step; "busy" when the
    window evaluated or saved a checkpoint. On a GPU each such read waits for the device. Reads inside
    torch and the named `libraries` (module names) are not the template's and are left out, and so are
    those of other threads (the background checkpoint writer reads host copies, never the device)."""
    import functools
    import threading

    from common.checkpoint import CheckpointManager

    import torch
    from accelerate import Accelerator

    skipped = tuple(str(Path(importlib.import_module(name).__file__).parent) for name in ("torch", *libraries))
    windows: list[dict] = [{"syncs": [], "busy": False}]
    for name in HOST_SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(tensor, *a, _original=original, _name=name, **k):
            if threading.current_thread() is not threading.main_thread():
                return _original(tensor, *a, **k)
            caller = sys._getframe(1)
            # torch's own host-side reads (the sampler's indices, a CPU optimizer's step counters) are on the
            # host on a GPU too; the templates, common/ and accelerate are where device values get read.
            if not caller.f_code.co_filename.startswith(skipped):
                windows[-1]["syncs"].append(f"{_name} in {Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            return _original(tensor, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def marking(owner, name):
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*a, **k):
            windows[-1]["busy"] = True  # evaluation, checkpoint or export: not an ordinary step
            return original(*a, **k)

        monkeypatch.setattr(owner, name, wrapper)

    marking(Accelerator, "gather_for_metrics")
    marking(CheckpointManager, "_checkpoint")  # a save, at the step or in the background
    real_step = torch.optim.AdamW.step

    @functools.wraps(real_step)
    def step(*a, **k):
        result = real_step(*a, **k)
        windows.append({"syncs": [], "busy": False})
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return windows


def assert_one_host_sync_per_ordinary_step(windows: list[dict]) -> None:
    # The window before the first step also holds the start-up; the one after the last, the end.
    ordinary = [w["syncs"] for w in windows[1:-1] if not w["busy"]]
    assert len(ordinary) >= 2, f"too few ordinary steps to judge: {len(windows)} windows"
    assert max(len(syncs) for syncs in ordinary) <= 1, [syncs for syncs in ordinary if len(syncs) > 1][:3]
