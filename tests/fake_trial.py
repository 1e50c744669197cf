"""Test helper: a stand-in for a template that logs a metric like one, in milliseconds, without torch.

Takes `--name=value` options (unknown ones are ignored, like sweep parameters it does not use):
    --output_dir   where metrics.jsonl goes (required)
    --score        the value the metric climbs to (default: --learning_rate, else 0.5); --seed adds seed/100
    --evals        evaluations to log (default 3), --sleep seconds between them (default 0.05)
    --values       the metric's value at each evaluation, comma-separated (instead of --score and --evals)
    --linger       seconds to go on after the last evaluation (a stand-in for the final save), then exit 0
    --wait_for     after the last evaluation, wait until this file exists (at most 120 s), then exit 0
    --metric       the metric's name (default val/accuracy)
    --ledger       append "<output_dir>\n" to this file at start (to count how often a trial ran)
    --child        also start a child process that sleeps (a stand-in for a rank)
    --ignore_term  ignore SIGTERM (so only SIGKILL ends it), also in the child
    --fail         after the first evaluation: print "error: <value>" and exit 2
    --crash        after the first evaluation: raise RuntimeError(<value>), print its traceback, exit 1
                   (both then print the traceback `accelerate launch` adds when its child fails)
    --status       write status.json as the templates do: "running" at start, then this end state
                   (finished, or failed with --fail's line and exit code 3); --exit_code: exit with it
"""

import json
import os
import signal
import subprocess
import sys
import time
import traceback



def launcher_trailer(code: int) -> None:
    """What `accelerate launch` prints after its child failed, then exit like it."""
    print("Traceback (most recent call last):\n"
          "  File \"accelerate/commands/launch.py\", line 1049, in _run_subprocess\n"
          f"subprocess.CalledProcessError: Command '['python', 'train.py']' returned non-zero exit status {code}.",
          file=sys.stderr)
    sys.exit(code)


opts = {}
for token in sys.argv[1:]:
    key, _, value = token[2:].partition("=")
    opts[key] = value

out = opts["output_dir"]
os.makedirs(out, exist_ok=True)
if opts.get("ledger"):
    with open(opts["ledger"], "a") as ledger:
        ledger.write(out + "\n")
if opts.get("ignore_term") in ("True", "true", "1"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if opts.get("child") in ("True", "true", "1"):
    code = "import signal, time\n"
    if opts.get("ignore_term") in ("True", "true", "1"):
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "time.sleep(600)\n"
    subprocess.Popen([sys.executable, "-c", code, f"fake-rank-of {out}"])

def write_status(state: str, **fields) -> None:
    with open(os.path.join(out, "status.json"), "w") as handle:
        json.dump({"state": state, "step": fields.pop("step", 0), **fields}, handle)


if opts.get("status"):
    write_status("running")
score = float(opts.get("score") or opts.get("learning_rate") or 0.5) + int(opts.get("seed") or 0) / 100
evals, pause = int(opts.get("evals", 3)), float(opts.get("sleep", 0.05))
values = [float(v) for v in opts["values"].split(",")] if opts.get("values") else None
if values:
    evals = len(values)
metric = opts.get("metric", "val/accuracy")
for i in range(1, evals + 1):
    time.sleep(pause)
    value = values[i - 1] if values else score * i / evals
    with open(os.path.join(out, "metrics.jsonl"), "a") as handle:
        handle.write(json.dumps({"step": 10 * i, "train/loss": 1.0 / i}) + "\n")
        handle.write(json.dumps({"step": 10 * i, metric: value, "epoch": i}) + "\n")
    if i == 1 and opts.get("fail"):
        print(f"error: {opts['fail']}", file=sys.stderr)
        if opts.get("status") == "failed":
            write_status("failed", step=10, exit_code=3, error=opts["fail"])
        launcher_trailer(2)
    if i == 1 and opts.get("crash"):
        try:
            raise RuntimeError(opts["crash"])
        except RuntimeError:
            traceback.print_exc()
        launcher_trailer(1)
time.sleep(float(opts.get("linger") or 0))
if opts.get("wait_for"):
    deadline = time.monotonic() + 120
    while not os.path.exists(opts["wait_for"]) and time.monotonic() < deadline:
        time.sleep(0.05)
print("done")
if opts.get("status") == "finished":
    write_status("finished", step=10 * evals, exit_code=0)
sys.exit(int(opts.get("exit_code") or 0))
