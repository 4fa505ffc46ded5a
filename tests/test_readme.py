"""The README's test command is exactly what CI runs."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    if not (ROOT / ".ci" / "run").exists():
        pytest.skip("not run from a source checkout")
    command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert command in (ROOT / "README.md").read_text()
