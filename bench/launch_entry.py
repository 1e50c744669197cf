"""Entry point for launched benchmark runs: the template's own main() with harness probes.

    accelerate launch ... bench/launch_entry.py <template> <probe_prefix> [--time-loader] -- <template args>

Each rank writes what the probes saw to <probe_prefix>.rank<N>.json. Used by scaling.py and gpu.py
through harness.launch().
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def main() -> None:
    if "--" not in sys.argv or len(sys.argv) < 4:
        sys.exit(__doc__)
    split = sys.argv.index("--")
    own, template_args = sys.argv[1:split], sys.argv[split + 1:]
    template, prefix = own[0], Path(own[1])
    module = harness.load_template(template)
    probe = harness.Probe()
    try:
        with harness.probed(module, probe, time_loader="--time-loader" in own):
            probe.info["result"] = module.main(template_args)
    finally:
        probe.stop_loader_workers()
        rank = int(os.environ.get("RANK", "0"))
        probe.info["rank"] = rank
        prefix.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{prefix}.rank{rank}.json").write_text(json.dumps(probe.to_json(), default=str))


if __name__ == "__main__":
    main()
