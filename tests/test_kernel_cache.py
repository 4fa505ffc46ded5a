"""The package's compiled-code cache is dropped whenever any of its modules changes, not only the
module that defines a cached function (numba's own check), since compiled callers inline callees."""
import os

from allreduce_kit.kernels import cache


def _package(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub" / "__pycache__").mkdir(parents=True)
    (package / "__pycache__").mkdir()
    (package / "caller.py").write_text("def loop(): return helper()\n")
    (package / "sub" / "helper.py").write_text("def helper(): return 1\n")
    return package


def _cached(package):
    files = [package / "__pycache__" / "caller.loop-1.py311.nbi", package / "__pycache__" / "caller.loop-1.py311.1.nbc",
             package / "sub" / "__pycache__" / "helper.helper-1.py311.nbi"]
    for f in files:
        f.write_bytes(b"compiled")
    return files


def test_a_changed_callee_drops_its_callers_cache_too(tmp_path):
    package = _package(tmp_path)
    stamp_file = package / "__pycache__" / "stamp"
    cache.refresh(package, stamp_file)  # first start: nothing recorded yet
    files = _cached(package)
    assert not cache.refresh(package, stamp_file), "unchanged sources keep the cache"
    assert all(f.exists() for f in files)
    (package / "sub" / "helper.py").write_text("def helper(): return 2\n")
    assert cache.refresh(package, stamp_file)
    assert not any(f.exists() for f in files), "the caller's cached code held the old helper inlined"


def test_the_same_text_written_again_keeps_the_cache(tmp_path):
    package = _package(tmp_path)
    stamp_file = package / "__pycache__" / "stamp"
    cache.refresh(package, stamp_file)
    files = _cached(package)
    helper = package / "sub" / "helper.py"
    helper.write_text(helper.read_text())  # a reinstall of the same version: new times, same text
    os.utime(helper, ns=(1, 1))
    assert not cache.refresh(package, stamp_file)
    assert all(f.exists() for f in files)
    assert not cache.refresh(package, stamp_file)


def test_where_no_stamp_can_be_kept_nothing_is_dropped(tmp_path):
    package = _package(tmp_path)
    files = _cached(package)
    assert not cache.refresh(package, tmp_path / "missing-folder" / "deeper" / "stamp")
    assert all(f.exists() for f in files)


def test_the_installed_package_has_a_current_stamp():
    assert cache.STAMP.is_file() and cache.STAMP.read_text().split()[1] == cache.stamp()


RACE = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import numpy as np
import kernel
from allreduce_kit.kernels import cache
if sys.argv[3] == "locked":
    cache.one_at_a_time(kernel.scale, Path(sys.argv[1]) / "compile.lock")
Path(sys.argv[1], "ready-" + sys.argv[2]).touch()
while len(list(Path(sys.argv[1]).glob("ready-*"))) < 2:     # start together, as the ranks of a job do
    time.sleep(0.001)
print(kernel.scale(np.ones(3)).sum())
"""


def _race(tmp_path, mode):
    import subprocess
    import sys

    (tmp_path / "kernel.py").write_text("from numba import njit\n\n\n@njit(cache=True)\n"
                                        "def scale(a):\n    return a * 2.0 + np.sin(a) * 0.0\n\n\nimport numpy as np\n")
    env = dict(os.environ, NUMBA_DEBUG_CACHE="1")
    runs = [subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path), str(i), mode], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env) for i in range(2)]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert all(run.returncode == 0 and "6.0" in out for run, out in zip(runs, outputs)), outputs
    return [out.count("data saved") for out in outputs]


def test_processes_that_start_together_compile_a_kernel_once(tmp_path):
    """Under the node's lock the first process compiles into the cache and the other loads it."""
    assert sorted(_race(tmp_path, "locked")) == [0, 1]
