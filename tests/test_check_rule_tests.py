"""scripts/check_rule_tests.py stays in step with the code: every mutation's text is still found exactly
once in its file, and every test it names is still collected. The script's full run (each mutation's
tests, about 5 minutes) is not part of the suite; this dry run catches drift in seconds."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "scripts" / "check_rule_tests.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_list_names_every_mutation_once():
    result = run("--list")
    assert result.returncode == 0, result.stderr
    names = [line.split()[0] for line in result.stdout.splitlines()]
    assert len(names) >= 25 and len(names) == len(set(names))
    assert {"no-set-epoch-image", "clip-before-unscale", "export-written-by-every-rank"} <= set(names)


def test_every_mutation_still_applies_and_names_existing_tests():
    result = run("--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every text found once, every test collected" in result.stdout


def test_a_mutation_that_no_longer_matches_the_code_is_an_error(monkeypatch, capsys):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import check_rule_tests
    finally:
        sys.path.remove(str(SCRIPT.parent))
    stale = check_rule_tests.mutation("stale", "loaders", "common/data.py", "text that is not there", "x", tests=())
    monkeypatch.setattr(check_rule_tests, "MUTATIONS", [stale])
    assert check_rule_tests.main(["--check"]) == 2
    assert "0 occurrences of 'text that is not there' in common/data.py" in capsys.readouterr().err
