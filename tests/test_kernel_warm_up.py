"""``kernels.warm_up`` loads the kernels of the dtypes and ops asked for, and only those."""
import os
import subprocess
import sys

import pytest

from conftest import TESTS

PROBE = """
import numpy as np
from allreduce_kit import kernels
from allreduce_kit.kernels import reduce as k
kernels.warm_up([np.float32], ["max"])
kernels.warm_up([np.float64], ["mean"])
print({name: sorted(str(s[0].dtype) for s in getattr(k, name).signatures)
       for name in ("combine", "combine_parallel", "divide", "fsum_divide", "isum_divide")})
"""


def test_warm_up_loads_what_the_ops_and_dtypes_use():
    """In a fresh process: max on float32 needs the combining kernel only; mean on float64 adds the division."""
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=TESTS,
                            env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = eval(result.stdout.strip().splitlines()[-1])
    assert loaded == {"combine": ["float32", "float64"], "combine_parallel": [], "divide": ["float64"],
                      "fsum_divide": ["float64"], "isum_divide": []}


def test_warm_up_names_an_unknown_op():
    from allreduce_kit import kernels

    with pytest.raises(ValueError, match="unknown op 'avg'"):
        kernels.warm_up(ops=["avg"])
