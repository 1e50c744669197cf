"""Where code lives: common/ holds only what the templates import; the search tools live in search/, beside it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO, clean_env


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (`import a.b` and `from a.b import c` give "a.b")."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # from common import data
    return names


def test_every_module_in_common_is_imported_by_a_template():
    """Users copy one template and common/: nothing in common/ may be there for anything else.

    A module counts as used when a template imports it, or a used module of common/ does."""
    templates = sorted((REPO / "templates").glob("*.py"))
    assert templates
    used = set().union(*(imported_modules(path) for path in templates))
    modules = sorted(p.stem for p in (REPO / "common").glob("*.py") if p.stem != "__init__")
    assert modules
    reached: set[str] = set()
    while new := {name for name in modules if f"common.{name}" in used} - reached:
        reached |= new
        used |= set().union(*(imported_modules(REPO / "common" / f"{name}.py") for name in new))
    unused = [f"common/{name}.py" for name in modules if name not in reached]
    assert unused == [], f"imported by no template (move it out of common/): {unused}"


def test_common_holds_at_most_twelve_small_modules():
    """What a project copies stays small enough to read: one job per module, twelve modules at most, none over
    500 lines."""
    modules = {p.name: len(p.read_text().splitlines()) for p in (REPO / "common").glob("*.py") if p.stem != "__init__"}
    assert len(modules) <= 12, sorted(modules)
    assert {name: lines for name, lines in modules.items() if lines > 500} == {}


# The layers of common/, lowest first. A module imports only modules of lower layers, so each can be read (and
# tested) knowing only what is below it, and none looks another up through sys.modules (an edge no import shows).
# What a higher module needs from a lower one's objects is handed over where the template's main() builds them:
# `preemption.check_step(grad_norm, ckpt)`, `@with_exit_codes(release=release_process_group)`.
LAYERS = (
    ("errors", "curves"),  # errors and exit codes, status.json; curves.png: the search tools import both, without torch
    ("config", "pickle_allowlist", "background_save"),  # options; what a checkpoint may unpickle; save_state's mirror
    ("export", "pretrained"),  # the final weights (loaded with torch and safetensors only); FSDP2 loading, LoRA saves
    ("data", "optim", "tracking"),
    ("checkpoint",),  # the checkpoint policy: when to save, what to keep, what a resume refuses
    ("accelerator",),  # the run: Accelerator, stop signals, start and end
)


def test_common_modules_import_only_modules_of_lower_layers():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    modules = sorted(p.stem for p in (REPO / "common").glob("*.py") if p.stem != "__init__")
    assert sorted(layer) == modules, "give every module of common/ its layer in LAYERS"
    offenders = []
    for name in modules:
        path = REPO / "common" / f"{name}.py"
        imported = {m.split(".")[1] for m in imported_modules(path) if m.startswith("common.")}
        offenders += [f"common/{name}.py imports common.{other}" for other in sorted(imported)
                      if other in layer and layer[other] >= layer[name]]
        offenders += [f"common/{name}.py: {line.strip()}" for line in path.read_text().splitlines()
                      if re.search(r"sys\.modules\b.*[\"']common\b", line)]
    assert offenders == [], offenders


def test_common_does_not_import_the_search_tools():
    """A template's copy of common/ has no search/ beside it."""
    offenders = sorted(f"{path.relative_to(REPO)}: {name}" for path in (REPO / "common").glob("*.py")
                       for name in imported_modules(path) if name == "search" or name.startswith("search."))
    assert offenders == []


def test_the_search_tools_load_without_torch_or_accelerate():
    """The runners only start trials (which load torch in their own processes); they import no torch themselves."""
    code = ("import sys, search, search.runner, search.seeds, search.sweep, search.trial; "
            "print(sorted(m for m in ('torch', 'accelerate') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_search_tools_need_only_common_beside_them():
    """A project copies search/ next to common/ for `python -m search`: nothing else of this repository is needed."""
    local = {path.stem for path in REPO.glob("*.py")} | {path.parent.name for path in REPO.glob("*/*.py")}
    local -= {"common", "search"}  # (the sweep files' folder holds no Python: `sweeps` is wandb's sweep engine)
    offenders = sorted(f"{path.relative_to(REPO)}: {name}" for path in (REPO / "search").glob("*.py")
                       for name in imported_modules(path) if name.split(".")[0] in local)
    assert offenders == []
