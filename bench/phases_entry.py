"""Entry point of bench/finetune_phases.py's launches: a checkout's fine-tuning template, its functions timed.

    accelerate launch ... bench/phases_entry.py <checkout> <events.json> -- <template args>

Loads <checkout>/templates/finetune_causal_lm.py (that checkout's common/ with it), wraps the names the template
looks up at run time with timers (wall clock, so that the launching process can place its own times beside them),
runs its `main()` and writes the events to <events.json> (rank 0).
"""

from __future__ import annotations

import time

ENTERED = time.time()  # before any import: the end of the launcher's part

import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

TIMED = ("load_tokenizer_and_config", "load_examples", "load_model", "evaluate", "answer_probes", "export_model",
         "sample", "end_run")


def timed(events: list, name: str, function):
    def wrapper(*args, **kwargs):
        start = time.time()
        try:
            return function(*args, **kwargs)
        finally:
            events.append((name, start, time.time()))
    return wrapper


def main() -> None:
    split = sys.argv.index("--")
    checkout, events_file = Path(sys.argv[1]), Path(sys.argv[2])
    path = checkout / "templates" / "finetune_causal_lm.py"
    spec = importlib.util.spec_from_file_location("finetune_causal_lm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["finetune_causal_lm"] = module
    spec.loader.exec_module(module)
    record = {"entry": ENTERED, "imported": time.time(), "events": [], "steps": [], "loop_start": None}
    events = record["events"]
    for name in TIMED:
        setattr(module, name, timed(events, name, getattr(module, name)))

    manager = module.CheckpointManager

    class CheckpointManager(manager):
        pass

    for name in ("save", "wait", "restore_best", "resume"):
        setattr(CheckpointManager, name, timed(events, name, getattr(manager, name)))
    module.CheckpointManager = CheckpointManager
    progress_bar = module.progress_bar

    def probed_bar(*args, **kwargs):
        record["loop_start"] = time.time()  # the bar is made just before the training loop
        bar = progress_bar(*args, **kwargs)
        update = bar.update

        def timed_update(n=1):
            record["steps"].append(time.time())
            return update(n)

        bar.update = timed_update
        return bar

    module.progress_bar = probed_bar
    try:
        module.main(sys.argv[split + 1:])
    finally:
        if os.environ.get("RANK", "0") == "0":
            with contextlib.suppress(OSError):
                events_file.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
