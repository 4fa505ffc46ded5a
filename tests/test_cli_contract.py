"""Every CLI has ``--help`` and ``--version`` and refuses an unknown option with status 2 and
one message, without a traceback (one process: no launcher needed to ask these)."""
import argparse
import re
import subprocess
import sys

import pytest

from allreduce_kit.cli import DefaultsFormatter

CLIS = ["allreduce_kit.train", "allreduce_kit.bench", "allreduce_kit.launch", "allreduce_kit.compare",
        "allreduce_kit.kernels", "allreduce_kit.run"]


def run(tmp_path, module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)


def says_a_default_twice(help_text: str) -> bool:
    return re.search(r"\(default: [^()]*\)\s*\(default:", " ".join(help_text.split())) is not None


@pytest.mark.parametrize("module", CLIS)
def test_help(tmp_path, module):
    result = run(tmp_path, module, "--help")
    assert result.returncode == 0 and "usage:" in result.stdout and not result.stderr.strip()
    assert not says_a_default_twice(result.stdout), result.stdout


def test_help_says_each_default_once_in_the_options_own_words_where_it_has_them():
    parser = argparse.ArgumentParser(formatter_class=DefaultsFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every version")
    parser.add_argument("--batch", type=int, default=0, help="samples per step (default: the model's)")
    parser.add_argument("--json", help="write JSON to PATH")
    text = " ".join(parser.format_help().split())
    assert "rounds of every version (default: 3)" in text
    assert "samples per step (default: the model's)" in text and "(default: 0)" not in text
    assert "write JSON to PATH" in text and "(default: None)" not in text


@pytest.mark.parametrize("module", CLIS)
def test_version(tmp_path, module):
    from allreduce_kit import __version__

    result = run(tmp_path, module, "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"allreduce_kit {__version__}"


@pytest.mark.parametrize("module", [m for m in CLIS if m != "allreduce_kit.run"])
def test_an_unknown_option_is_status_2(tmp_path, module):
    result = run(tmp_path, module, "--bogus", "x")
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus" in result.stderr and "Traceback" not in result.stderr
