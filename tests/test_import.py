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


# -- allreduce_kit.torch: the import changes nothing; init() prepares MPI's start as the launcher does --

TORCH_PROBE = """
import json, os, sys, warnings
NAMES = ("MPIR_CVAR_ENABLE_HEAVY_YIELD", "OMPI_MCA_mpi_yield_when_idle")
seen = {{}}
def audit(event, args):
    if event == "import" and args[0] == "mpi4py.MPI" and "at_mpi_start" not in seen:
        seen["at_mpi_start"] = {{name: os.environ.get(name) for name in NAMES}}
sys.addaudithook(audit)
before = (dict(os.environ), sys.excepthook)
{first}
import allreduce_kit.torch as hvd
seen["import_changes_nothing"] = (dict(os.environ), sys.excepthook) == before
seen["mpi_imported_by_import"] = "mpi4py.MPI" in sys.modules
seen["names_before_init"] = [hvd.Average, hvd.Sum, hvd.Compression.fp16.__name__, hvd.is_initialized()]
seen["mpi_imported_before_init"] = "mpi4py.MPI" in sys.modules
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    hvd.init()
seen["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("allreduce_kit")]
seen["set_by_init"] = {{k: v for k, v in os.environ.items() if before[0].get(k) != v}}
seen["rank_size"] = [hvd.rank(), hvd.size()]
hvd.shutdown()
print(json.dumps(seen))
"""


def torch_probe(tmp_path, env, first: str = "") -> dict:
    import os

    pytest.importorskip("torch")
    clean = {k: v for k, v in os.environ.items() if k not in ("MPIR_CVAR_ENABLE_HEAVY_YIELD", "OMPI_MCA_mpi_yield_when_idle")}
    result = subprocess.run([sys.executable, "-c", TORCH_PROBE.format(first=first)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, env=dict(clean, **env))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_allreduce_kit_torch_changes_nothing_and_init_sets_yield_before_mpi_starts(tmp_path):
    # MPI_LOCALNRANKS says "more ranks on this node than cores": what plain mpirun -n 4 on 2 cores says
    seen = torch_probe(tmp_path, {"MPI_LOCALNRANKS": "4096"})
    assert seen["import_changes_nothing"] and not seen["mpi_imported_by_import"]
    assert seen["names_before_init"] == ["mean", "sum", "FP16Compressor", False] and not seen["mpi_imported_before_init"]
    assert seen["at_mpi_start"] == {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "OMPI_MCA_mpi_yield_when_idle": None}
    assert seen["set_by_init"] == {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
    assert seen["warnings"] == [] and seen["rank_size"] == [0, 1]


@pytest.mark.parametrize("env,expected", [
    ({"MPI_LOCALNRANKS": "1"}, {}),                                                       # a core each
    ({"MPI_LOCALNRANKS": "4096", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "0"}, {}),               # the user decides
    ({"MPI_LOCALNRANKS": "4096", "ALLREDUCE_KIT_YIELD": "0"}, {}),
    ({"MPI_LOCALNRANKS": "4096", "PMI_SIZE": "8192"}, {}),                                # spans nodes (MPICH)
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4096", "OMPI_COMM_WORLD_SIZE": "4096"}, {"OMPI_MCA_mpi_yield_when_idle": "1"}),
])
def test_torch_init_sets_yield_only_where_the_launcher_does(tmp_path, env, expected):
    seen = torch_probe(tmp_path, env)
    assert seen["set_by_init"] == expected and seen["warnings"] == []
    for name, value in expected.items():
        assert seen["at_mpi_start"][name] == value


def test_torch_init_after_mpi_started_warns_where_yield_was_wanted(tmp_path):
    seen = torch_probe(tmp_path, {"MPI_LOCALNRANKS": "4096"}, first="from mpi4py import MPI")
    assert seen["set_by_init"] == {} and seen["at_mpi_start"]["MPIR_CVAR_ENABLE_HEAVY_YIELD"] is None
    [warning] = seen["warnings"]
    assert "MPI started before init()" in warning and "MPIR_CVAR_ENABLE_HEAVY_YIELD=1" in warning
    assert "python -m allreduce_kit.run" in warning and "mpirun -genv MPIR_CVAR_ENABLE_HEAVY_YIELD 1" in warning
    assert torch_probe(tmp_path, {"MPI_LOCALNRANKS": "1"}, first="from mpi4py import MPI")["warnings"] == []
