"""The reduction kernels: ``dst op= src`` in place, for every op and dtype, serial or threaded.

No MPI here: the kernels know nothing of it.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from allreduce_kit import kernels
from allreduce_kit.kernels.stream import stream_copy

REPO = Path(__file__).resolve().parent.parent
NUMPY = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


@pytest.fixture(params=["serial", "threaded"])
def path(request, monkeypatch):
    """Run each test through the serial loop and through the prange loop."""
    if request.param == "threaded":
        if numba.config.NUMBA_NUM_THREADS < 2:
            pytest.skip("numba has one thread here")
        monkeypatch.setattr(kernels, "PARALLEL_MIN", 0)
        numba.set_num_threads(2)
    return request.param


def values(n, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-50, 50, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


@pytest.mark.parametrize("dtype", [d.name for d in kernels.DTYPES])
@pytest.mark.parametrize("op", kernels.OPS)
@pytest.mark.parametrize("n", [0, 1, 7, 100_003])
def test_reduce_into_matches_numpy(path, op, dtype, n):
    dst, src = values(n, dtype, 1), values(n, dtype, 2)
    expected = NUMPY[op](dst, src)
    kernels.reduce_into(dst, src, op)
    assert dst.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(dst, expected)


def test_works_in_place_on_views():
    buf = np.arange(10, dtype=np.float64)
    kernels.reduce_into(buf[2:5], np.ones(3), "sum")
    assert buf.tolist() == [0, 1, 3, 4, 5, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_integer_sum_and_prod_wrap_around(dtype):
    big = np.iinfo(dtype).max
    dst = np.array([big, big], dtype)
    kernels.reduce_into(dst, np.array([1, 2], dtype), "sum")
    assert dst.tolist() == [np.iinfo(dtype).min, np.iinfo(dtype).min + 1]


@pytest.mark.parametrize("op", ["max", "min"])
def test_max_and_min_propagate_nan_in_either_position(path, op):
    a = np.array([np.nan, 1.0, np.nan], np.float32)
    b = np.array([1.0, np.nan, np.nan], np.float32)
    kernels.reduce_into(a, b, op)
    assert np.isnan(a).all()


def test_signed_zeros_give_the_same_bits_in_either_order(path):
    for op, want in (("max", 0.0), ("min", -0.0)):
        for first, second in ((0.0, -0.0), (-0.0, 0.0)):
            dst, src = np.array([first]), np.array([second])
            kernels.reduce_into(dst, src, op)
            assert dst[0] == 0 and np.signbit(dst[0]) == np.signbit(want), (op, first, second)


def test_divide_floats_and_truncate_integers_toward_zero():
    f = np.array([1.0, -3.0, 7.0], np.float32)
    kernels.divide(f, 2)
    assert f.tolist() == [0.5, -1.5, 3.5]
    i = np.array([7, -7, 6, -6], np.int64)
    kernels.divide(i, 4)
    assert i.tolist() == [1, -1, 1, -1]


@pytest.mark.parametrize("dtype", [d.name for d in kernels.DTYPES])
def test_sum_divide_is_sum_then_divide_in_one_pass(dtype):
    dst, src = values(1001, dtype, 3), values(1001, dtype, 4)
    expected = dst + src
    expected = expected / 3 if expected.dtype.kind == "f" else np.trunc(expected / 3)
    kernels.sum_divide_into(dst, src, 3)
    np.testing.assert_allclose(dst, expected.astype(dtype), rtol=1e-6)


@pytest.mark.parametrize("dtype", [d.name for d in kernels.DTYPES])
def test_copy_moves_every_bit_into_the_destination_range_only(dtype):
    # The compiled copy the shared-memory algorithm moves data with: NaN payloads and -0.0 are
    # copied as bits, and nothing outside ``dst`` is touched.
    src = values(1001, dtype, 5)
    if src.dtype.kind == "f":
        src[:3] = [np.nan, -0.0, np.inf]
    outer = np.full(1005, 7, dtype)
    kernels.reduce.copy(outer[2:1003], src)
    assert outer[:2].tolist() == [7, 7] and outer[1003:].tolist() == [7, 7]
    assert outer[2:1003].tobytes() == src.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 33, 1000, 100_003])
@pytest.mark.parametrize("start", [0, 1, 5, 13])
def test_stream_copy_moves_every_bit_into_the_destination_range_only(dtype, n, start):
    """The copy around the caches (``kernels.stream``): every element, at every alignment of the
    destination's start and end against a cache line, and nothing outside ``dst``."""
    src = values(n + 7, dtype, n)[7 - start % 7:][:n]   # the source misaligned another way
    if n >= 3:
        src[:3] = [np.nan, -0.0, np.inf]
    outer = np.full(n + 40, 7, dtype)
    stream_copy(outer[start:start + n], src)
    assert (outer[:start] == 7).all() and (outer[start + n:] == 7).all()
    assert outer[start:start + n].tobytes() == src.tobytes()


IMPORT_PROBE = """
import json, sys
import numpy as np
import allreduce_kit.kernels as kernels
dst = np.ones(3, np.float32)
kernels.reduce_into(dst, np.ones(3, np.float32), "sum")
loaded = sorted(name for name in sys.modules if name == "mpi4py" or name.startswith("mpi4py."))
import mpi4py
mpi4py.rc.initialize = mpi4py.rc.finalize = False   # only ask: do not start MPI here
from mpi4py import MPI
print(json.dumps({"mpi4py_modules": loaded, "mpi_initialized": MPI.Is_initialized(),
                  "sum": dst.tolist(), "file": kernels.__file__}))
"""


def test_importing_the_kernels_starts_no_mpi(tmp_path):
    """``import allreduce_kit.kernels`` in a fresh process, from outside the source tree (so the
    installed package is the one imported), loads no part of mpi4py and leaves MPI uninitialised;
    the kernels work."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["sum"] == [2.0, 2.0, 2.0]
    source = {REPO / "kernels", REPO / "allreduce_kit"}
    assert not source & set(Path(seen["file"]).resolve().parents), f"imported from the source tree: {seen['file']}"
    assert seen["mpi4py_modules"] == [], f"importing the kernels imported {seen['mpi4py_modules']}"
    assert seen["mpi_initialized"] is False, "importing the kernels started MPI"


def test_a_second_process_loads_the_compiled_kernels_from_the_cache():
    """The first process compiles and writes numba's cache; the next one only loads it."""
    probe = ("import numpy as np; from allreduce_kit import kernels; from allreduce_kit.kernels import reduce;"
             "kernels.reduce_into(np.ones(3, np.float32), np.ones(3, np.float32), 'sum');"
             "print(sum(reduce.combine.stats.cache_misses.values()), sum(reduce.combine.stats.cache_hits.values()))")
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                             cwd=Path(__file__).parent, check=True).stdout.split()
    misses, hits = map(int, out)
    assert (misses, hits) == (0, 1), "the second start should compile nothing"


@pytest.mark.parametrize("threads", [0, 1, 2, 3])
def test_a_thread_cap_changes_nothing_but_the_threads(threads):
    """``threads`` caps the threads a large fold uses (0: numba's setting); the result is the
    same, and numba's own setting is as it was afterwards."""
    before = numba.get_num_threads()
    dst, src = values(kernels.PARALLEL_MIN + 5, "float32", 1), values(kernels.PARALLEL_MIN + 5, "float32", 2)
    expected = dst + src
    kernels.reduce_into(dst, src, "sum", threads)
    np.testing.assert_array_equal(dst, expected)
    assert numba.get_num_threads() == before
