"""``allreduce_kit.torch`` from the outside: an optional extra that importing the package does not
pull in, and ``examples/torch_digits.py`` training under ``mpiexec`` at 8 ranks.

The collectives and ``DistributedOptimizer`` against references at every rank count:
``tests/mpi/test_torch.py``, run by ``test_mpi_suite.py``.
"""
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from conftest import TESTS

pytest.importorskip("torch")

EXAMPLES = TESTS.parent / "examples"


def modules_after(imports: str, tmp_path) -> set:
    code = f"import sys\n{imports}\nprint(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_importing_allreduce_kit_and_using_it_does_not_import_torch(tmp_path):
    loaded = modules_after("import allreduce_kit\nfrom allreduce_kit import allreduce, average_arrays, library_comm\n"
                           "import allreduce_kit.train.trainer", tmp_path)
    assert "allreduce_kit.train.trainer" in loaded and "mpi4py.MPI" in loaded
    assert "torch" not in loaded
    assert "torch" in modules_after("import allreduce_kit.torch", tmp_path)


def test_torch_is_an_extra_pinned_to_the_cpu_build():
    requires = metadata.requires("allreduce_kit") or []
    pinned = [r for r in requires if r.replace(" ", "").startswith("torch==")]
    assert any('extra == "torch"' in r for r in pinned), requires
    assert any('extra == "test"' in r for r in pinned), requires
    assert all(r.replace(" ", "").startswith("torch==2.13.0;") for r in pinned), pinned
    assert not any(r.startswith("torch") and "extra" not in r for r in requires), "torch must not be a hard dependency"


@pytest.mark.slow
def test_torch_digits_example_at_8_ranks(mpirun, tmp_path):
    out = tmp_path / "report.json"
    result = mpirun(8, ["-m", "allreduce_kit.run", EXAMPLES / "torch_digits.py", "--epochs", "8", "--json", out],
                    timeout=600, via_mpi4py=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "on 8 ranks; replicas bitwise identical: yes" in result.stdout, result.stdout[-3000:]
    accuracy = float(re.findall(r"test accuracy ([0-9.]+)% on 8 ranks", result.stdout)[-1])
    assert accuracy >= 90.0, result.stdout[-3000:]
    assert "DistributedOptimizer: straggler report over" in result.stdout
    report = json.loads(Path(out).read_text())
    assert len(report["straggler"]["ranks"]) == 8 and report["straggler"]["steps"] > 0
    assert len(report["overlap"]["hidden_share"]) == report["straggler"]["steps"]


def test_every_public_name_is_the_function_or_class_not_a_module_of_the_same_name(tmp_path):
    """Names load on first use; a submodule imported by another (``calls`` imports the module
    that reduce-scatters rows) must never shadow a public function of the package."""
    code = ("import types, allreduce_kit.torch as hvd\nhvd.init()\n"
            "bad = [n for n in hvd.__all__ if isinstance(getattr(hvd, n), types.ModuleType)]\n"
            "missing = [n for n in hvd.__all__ if not hasattr(hvd, n)]\nprint(bad, missing)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "[] []", result.stdout
