"""Test helper, launched in place of a template: record the config this rank parsed, then train.

    PROBE_TEMPLATE=templates/x.py PROBE_DIR=/tmp/out accelerate launch ... tests/sweep_probe.py --opt=value ...

Every rank parses its argv with the template's own `parse_config(Config, argv)` and writes the result to
$PROBE_DIR/rank_<RANK>.json; then the template's `main(argv)` runs as usual (and writes run.json).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("template_under_test", os.environ["PROBE_TEMPLATE"])
template = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = template  # dataclasses look their module up while the file runs
spec.loader.exec_module(template)

argv = sys.argv[1:]
config = template.parse_config(template.Config, argv)
record = Path(os.environ["PROBE_DIR"], f"rank_{os.environ.get('RANK', '0')}.json")
record.write_text(json.dumps(dataclasses.asdict(config)))
template.main(argv)
