"""Shared pieces every template needs: config, accelerator, data, checkpoints, tracking."""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType

OURS = Path(__file__).resolve().parent


def is_ours(module: ModuleType) -> bool:
    """Whether `module` is this `common` package or one of its modules (not another project's `common`)."""
    return OURS in Path(getattr(module, "__file__", None) or "/").resolve().parents


def hand_back(theirs: dict[str, ModuleType], imported: bool) -> None:
    """After a template imported its modules: give the name `common` back to the program that imported the
    template, when that program has a `common` of its own (a monorepo's: set aside as `theirs` while ours was
    imported, or found on its path). The template keeps what it imported; a later `import common` is theirs.
    A template run as a program (`imported` false) is a process of its own: nothing to hand back."""
    if not imported:
        return
    path = [entry for entry in sys.path if isinstance(entry, str)]
    if str(OURS.parent) in path:
        path.remove(str(OURS.parent))  # the entry the template added
    if not theirs:  # none imported yet: would the program's own `import common` find another one?
        spec = importlib.machinery.PathFinder.find_spec("common", path)
        if spec is None or Path((spec.submodule_search_locations or [spec.origin])[0]).resolve() == OURS:
            return  # no: ours stays, as in any project
    for name in [name for name, module in sys.modules.items() if name.split(".")[0] == "common" and is_ours(module)]:
        del sys.modules[name]
    sys.modules.update(theirs)
    if str(OURS.parent) in sys.path:
        sys.path.remove(str(OURS.parent))
