"""Test helper, launched in place of a template: run the template's own main(), then report gloo's threads.

    python tests/finish_probe.py templates/x.py --opt ...    (under `accelerate launch`)

Prints `rank R: gloo threads left after main: N` once main() has returned or exited, and exits with
main()'s code. N counts this process's threads named by gloo (its collective workers `pt_gloo_runloop`
and its I/O loop); it must be 0: a thread still running into interpreter shutdown can abort the process
(common.accelerator.release_process_group). Linux only (thread names come from /proc).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def gloo_threads() -> int:
    tasks = Path("/proc/self/task")
    return sum("gloo" in (task / "comm").read_text() for task in tasks.iterdir())


def main() -> None:
    template = Path(sys.argv[1]).resolve()
    sys.argv = [str(template), *sys.argv[2:]]
    spec = importlib.util.spec_from_file_location(f"template_{template.stem}", template)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    code = 0
    try:
        module.main()
    except SystemExit as stop:
        code = stop.code
    print(f"rank {os.environ.get('RANK', '0')}: gloo threads left after main: {gloo_threads()}", flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
