"""Every CLI has ``--help`` and ``--version`` and refuses an unknown option with status 2 and
one message, without a traceback (one process: no launcher needed to ask these)."""
import subprocess
import sys

import pytest

CLIS = ["allreduce_kit.train", "allreduce_kit.bench", "allreduce_kit.launch", "allreduce_kit.compare",
        "allreduce_kit.kernels", "allreduce_kit.run"]


def run(tmp_path, module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)


@pytest.mark.parametrize("module", CLIS)
def test_help(tmp_path, module):
    result = run(tmp_path, module, "--help")
    assert result.returncode == 0 and "usage:" in result.stdout and not result.stderr.strip()


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
