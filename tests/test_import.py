"""Importing the package changes nothing in the process; abort-on-error and heavy yield are
asked for (``python -m allreduce_kit.run``, the CLIs, ``install_abort_hook``).

Each check runs in a fresh interpreter, started outside the source tree so that the installed
package is what gets imported.
"""
import json
import subprocess
import sys

import pytest

PROBE = """
import json, os, signal, sys
def handlers():
    return [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)]
before = (dict(os.environ), sys.excepthook, handlers())
{imports}
after = (dict(os.environ), sys.excepthook, handlers())
print(json.dumps({{
    "environ_same": before[0] == after[0],
    "excepthook_same": before[1] is after[1],
    "signals_same": before[2] == after[2],
    "mpi_imported": "mpi4py.MPI" in sys.modules,
    "numba_imported": "numba" in sys.modules,
}}))
"""


def probe(imports: str, tmp_path, env=None) -> dict:
    import os

    result = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, env=dict(os.environ, **(env or {})))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_allreduce_kit_changes_nothing(tmp_path):
    # MPI_LOCALNRANKS says "oversubscribed": an import used to set the yield variable then
    seen = probe("import allreduce_kit", tmp_path, env={"MPI_LOCALNRANKS": "4096"})
    assert seen == {"environ_same": True, "excepthook_same": True, "signals_same": True,
                    "mpi_imported": False, "numba_imported": False}


def test_import_kernels_does_not_start_mpi(tmp_path):
    seen = probe("import allreduce_kit.kernels", tmp_path)
    assert seen["mpi_imported"] is False and seen["environ_same"] and seen["excepthook_same"]


def test_using_the_api_starts_mpi_but_still_changes_nothing_else(tmp_path):
    seen = probe("from allreduce_kit import allreduce, ALGORITHMS", tmp_path, env={"MPI_LOCALNRANKS": "4096"})
    assert seen["mpi_imported"] is True
    assert seen["environ_same"] and seen["excepthook_same"] and seen["signals_same"]


def test_a_bad_setting_does_not_break_the_import(tmp_path):
    seen = probe("import allreduce_kit; from allreduce_kit import allreduce", tmp_path,
                 env={"ALLREDUCE_KIT_STALL_TIMEOUT": "soon", "ALLREDUCE_KIT_CHECK": "maybe"})
    assert seen["mpi_imported"] is True


def test_a_bad_setting_raises_at_first_use_naming_the_variable(tmp_path):
    import os

    code = "import numpy as np\nfrom allreduce_kit import allreduce\nallreduce(np.ones(4))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env=dict(os.environ, ALLREDUCE_KIT_STALL_TIMEOUT="soon"))
    assert result.returncode != 0
    assert "ValueError: ALLREDUCE_KIT_STALL_TIMEOUT='soon'" in result.stderr


LAUNCHED = """
import json, os, sys
from mpi4py import MPI
print(json.dumps({"yield": os.environ.get("MPIR_CVAR_ENABLE_HEAVY_YIELD"),
                  "open_mpi_yield": os.environ.get("OMPI_MCA_mpi_yield_when_idle"),
                  "hook": getattr(sys.excepthook, "_allreduce_kit_abort", False),
                  "argv": sys.argv, "name": __name__}))
"""


def launch(tmp_path, env, *args):
    import os

    script = tmp_path / "show.py"
    script.write_text(LAUNCHED)
    full = {k: v for k, v in os.environ.items() if k not in ("MPIR_CVAR_ENABLE_HEAVY_YIELD", "OMPI_MCA_mpi_yield_when_idle")}
    result = subprocess.run([sys.executable, "-m", "allreduce_kit.run", str(script), *args], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, env=dict(full, **env))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_launcher_sets_yield_before_mpi_starts_and_installs_the_abort_hook(tmp_path):
    seen = launch(tmp_path, {"MPI_LOCALNRANKS": "4096"}, "--flag", "x")
    assert seen == {"yield": "1", "open_mpi_yield": None, "hook": True, "argv": [str(tmp_path / "show.py"), "--flag", "x"],
                    "name": "__main__"}


@pytest.mark.parametrize("env,expected_yield", [
    ({"MPI_LOCALNRANKS": "1"}, None),                                       # a core each: no need
    ({}, None),                                                             # no launcher said anything
    ({"MPI_LOCALNRANKS": "4096", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "0"}, "0"),  # the user decides
    ({"MPI_LOCALNRANKS": "4096", "ALLREDUCE_KIT_YIELD": "0"}, None),
    # Slurm: 8 tasks on a node of 8 allocated CPUs, whatever this process's own affinity
    ({"SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_ON_NODE": "8"}, None),
    ({"SLURM_TASKS_PER_NODE": "4096", "SLURM_NTASKS": "4096"}, "1"),
    ({"MPI_LOCALNRANKS": "4096", "PMI_SIZE": "4096"}, "1"),
    # the job spans nodes: a heavy yield's sleep between polls would delay every message from them
    ({"MPI_LOCALNRANKS": "4096", "PMI_SIZE": "8192"}, None),
    ({"SLURM_TASKS_PER_NODE": "4096(x2)", "SLURM_NTASKS": "8192"}, None),
])
def test_the_launcher_sets_yield_only_when_oversubscribed_on_one_node_and_unset(tmp_path, env, expected_yield):
    assert launch(tmp_path, env)["yield"] == expected_yield


@pytest.mark.parametrize("env,expected_yield", [
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4096", "OMPI_COMM_WORLD_SIZE": "4096"}, "1"),
    # Open MPI's yield is a sched_yield, no sleep: a job that spans nodes wants it too
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4096", "OMPI_COMM_WORLD_SIZE": "8192"}, "1"),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_SIZE": "2"}, None),       # a core each: no need
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4096", "OMPI_COMM_WORLD_SIZE": "4096", "OMPI_MCA_mpi_yield_when_idle": "0"}, "0"),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4096", "OMPI_COMM_WORLD_SIZE": "4096", "ALLREDUCE_KIT_YIELD": "0"}, None),
])
def test_under_open_mpi_the_launcher_sets_its_yield_instead(tmp_path, env, expected_yield):
    seen = launch(tmp_path, env)
    assert seen["open_mpi_yield"] == expected_yield and seen["yield"] is None


def test_the_launcher_honours_abort_on_error_0(tmp_path):
    assert launch(tmp_path, {"ALLREDUCE_KIT_ABORT_ON_ERROR": "0"})["hook"] is False


@pytest.mark.parametrize("args,status", [([], 2), (["--help"], 0), (["/no/such/script.py"], 2)])
def test_the_launcher_reports_usage_errors(tmp_path, args, status):
    result = subprocess.run([sys.executable, "-m", "allreduce_kit.run", *args], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path)
    assert result.returncode == status
    assert "Traceback" not in result.stderr
