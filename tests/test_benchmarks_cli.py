"""The scripts in benchmarks/ as command lines: every option described, bad values refused cleanly.

Nothing here measures anything: each script is started only to parse its options.
"""
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TESTS
from test_cli_contract import says_a_default_twice

# Every script (a module that runs as __main__; training_runs.py is a helper the scripts import).
SCRIPTS = sorted(p for p in (TESTS.parent / "benchmarks").glob("*.py") if "__main__" in p.read_text())

# Runs a script until it parses its command line, then reports every option without a help text.
PROBE = """
import argparse, json, runpy, sys
def probe(self, args=None, namespace=None):
    undescribed = [a.option_strings or [a.dest] for a in self._actions if not (a.help or "").strip()]
    print("UNDESCRIBED " + json.dumps(undescribed))
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = probe
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run(args, timeout=60):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          cwd=TESTS)


def test_the_benchmarks_are_found():
    assert {p.name for p in SCRIPTS} >= {"sync_vs_async.py", "train_targets.py", "fault_latency.py"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_describes_every_option(script):
    done = _run(["-c", PROBE, script])
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("UNDESCRIBED "))
    assert line == "UNDESCRIBED []", f"{script.name}: options without a description: {line[12:]}"
    helped = _run([script, "--help"])
    assert helped.returncode == 0 and not says_a_default_twice(helped.stdout), helped.stdout


@pytest.mark.parametrize("script,known", [("train_targets.py", "wall, yield"), ("fault_latency.py", "stall, train-stall")])
def test_a_bad_only_value_is_one_message_not_a_traceback(script, known):
    good = known.split(",")[0]
    done = _run([TESTS.parent / "benchmarks" / script, "--only", f"{good},bogus"])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "argument --only: unknown 'bogus'" in done.stderr and known in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
