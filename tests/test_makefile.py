"""`make demo`'s rebuild rules, run by make itself on stand-ins for train_heads.py and medusa-bench that only
log their arguments and write the files the rules look for (no model runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"

TRAIN = """#!/bin/bash
echo "train $*" >> calls.log
out=$(echo "$*" | sed -n 's/.*output_dir=\\([^ ]*\\).*/\\1/p')
mkdir -p "$out/heads"
[ -f "$out/heads/config.json" ] && [ -z "$RETRAIN" ] || echo "$3" > "$out/heads/config.json"
"""
"""Writes the heads' config.json where it trains (a first run, or ``RETRAIN``), as train_heads.py does: a run
whose stages are all done skips them and leaves it as it was."""

BENCH = """#!/bin/bash
echo "bench $*" >> calls.log
out=$(echo "$*" | sed -n 's/.*--output \\([^ ]*\\).*/\\1/p')
echo '{}' > "$out/report.json"
echo table > "$out/report.md"
[ -z "$FAIL" ]
"""
"""Writes its report, then fails where ``FAIL`` is set, as medusa-bench does when a method fails midway."""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    shutil.copy(MAKEFILE, tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "recipes").mkdir()
    for name in ("a.yaml", "b.yaml"):
        (tmp_path / "recipes" / name).write_text(f"# {name}\n")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("python", TRAIN), ("medusa-bench", BENCH)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    past = time.time() - 60  # the stamp newer than the Makefile and pyproject.toml: installed
    for path in (tmp_path / "Makefile", tmp_path / "pyproject.toml"):
        os.utime(path, (past, past))
    (tmp_path / ".venv" / ".installed").touch()
    return tmp_path


def make_demo(tree: Path, *settings: str, **env: str) -> tuple[int, str]:
    """``make demo`` with ``settings``; its exit status and the stand-ins' calls, cleared for the next."""
    # (not the settings of a make running the tests: `make test VENV=...` passed VENV to this make in MAKEFLAGS)
    outer = {key: value for key, value in os.environ.items()
             if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "GNUMAKEFLAGS")}
    done = subprocess.run(["make", "demo", "DEMO_MIN_BENCH=60", *settings], cwd=tree, capture_output=True,
                          text=True, env={**outer, **env}, timeout=120)
    log = tree / "calls.log"
    calls = log.read_text() if log.exists() else ""
    log.write_text("")
    return done.returncode, calls


def test_another_recipe_trains_again(tree: Path) -> None:
    """A clone's recipes are older than heads trained since: DEMO_RECIPE=another showed the old heads' report
    as the new recipe's, running nothing."""
    code, calls = make_demo(tree, "DEMO_RECIPE=recipes/b.yaml")
    assert code == 0 and "--config recipes/b.yaml" in calls and "bench " in calls
    assert make_demo(tree, "DEMO_RECIPE=recipes/b.yaml") == (0, "")  # nothing changed: nothing runs
    code, calls = make_demo(tree, "DEMO_RECIPE=recipes/a.yaml", RETRAIN="1")
    assert code == 0 and "--config recipes/a.yaml" in calls and "bench " in calls


def test_a_recipe_edit_train_heads_reads_nothing_of_runs_it_once(tree: Path) -> None:
    """train_heads.py skips finished stages and leaves the heads' config.json as it was: after a comment was
    added to the recipe, every later `make demo` ran it again."""
    assert make_demo(tree, "DEMO_RECIPE=recipes/a.yaml")[0] == 0
    time.sleep(1.1)  # (file times in whole seconds on some file systems)
    with (tree / "recipes" / "a.yaml").open("a") as recipe:
        recipe.write("# a comment\n")
    code, calls = make_demo(tree, "DEMO_RECIPE=recipes/a.yaml")
    assert code == 0 and "train " in calls and "bench " not in calls  # no new heads: no new benchmark
    assert make_demo(tree, "DEMO_RECIPE=recipes/a.yaml") == (0, "")


def test_a_benchmark_that_failed_runs_again(tree: Path) -> None:
    """medusa-bench writes the questions measured before a method failed, and exits 1: the next `make demo`
    showed that report as the finished one."""
    code, calls = make_demo(tree, "DEMO_RECIPE=recipes/a.yaml", FAIL="1")
    assert code != 0 and "bench " in calls and not (tree / "runs" / "demo" / "report.json").exists()
    code, calls = make_demo(tree, "DEMO_RECIPE=recipes/a.yaml")
    assert code == 0 and "bench " in calls and "train " not in calls
    shutil.rmtree(tree / "runs" / "demo" / "heads")  # deleted to train again: trained again
    code, calls = make_demo(tree, "DEMO_RECIPE=recipes/a.yaml")
    assert code == 0 and "train " in calls and "bench " in calls


def test_the_settings_of_a_make_running_the_tests_do_not_reach_the_demo(tree: Path, monkeypatch) -> None:
    monkeypatch.setenv("MAKEFLAGS", " -- VENV=/nonexistent")  # as `make test VENV=/opt/venv` runs the tests
    code, calls = make_demo(tree, "DEMO_RECIPE=recipes/a.yaml")
    assert code == 0 and "train " in calls and "bench " in calls, calls


@pytest.mark.parametrize("setting", ["DEMO_MINUTES=0.5", "DEMO_MIN_BENCH=0"])
def test_time_settings_that_are_no_whole_number_are_named(tree: Path, setting: str) -> None:
    """DEMO_MINUTES=0.5 failed in the shell's arithmetic after training; DEMO_MIN_BENCH=0 in medusa-bench."""
    done = subprocess.run(["make", "demo", setting], cwd=tree, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DEMO_MINUTES and DEMO_MIN_BENCH must be whole numbers >= 1" in done.stderr
    assert not (tree / "calls.log").exists()
