"""Shared pieces every template needs: config, accelerator, data, checkpoints, tracking."""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType

OURS = Path(__file__).resolve().parent


def hand_back(theirs: dict[str, ModuleType], imported: bool) -> None:
    """After a template imported its modules: give the name `common` back to the program that imported the template,
    when that program has a `common` of its own (set aside as `theirs` while ours was imported, or the first one on its
    path); the template keeps what it imported. Nothing to do for a template run as a program (`imported` false)."""
    if not imported:
        return
    sys.path.remove(str(OURS.parent))  # the entry the template put first; the program's own entries stay
    spec = importlib.machinery.PathFinder.find_spec("common")  # what the program's `import common` would find
    if not theirs and (spec is None or Path((spec.submodule_search_locations or [spec.origin])[0]).resolve() == OURS):
        return  # ours, as in any project: it stays
    for name in [name for name in sys.modules if name.split(".")[0] == "common"]:  # ours alone: theirs set aside
        del sys.modules[name]
    sys.modules.update(theirs)
