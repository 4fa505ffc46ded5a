"""``benchmarks/copy_bound.py``: what bounds a one-node collective's time, beside MPI's and auto's.
Each row's bound follows its collective's rule: a reduce-scatter's is the floor, a broadcast's
the faster of one kernel copy (``cma``) and two copies through shared memory (``staged``), an
allgather's the same with its own block's copy added to the kernel's."""
import json
import math

import pytest

from conftest import TESTS, run_mpi


def test_each_collectives_bound_follows_its_rule_at_an_uneven_rank_count(tmp_path):
    out = tmp_path / "bound.json"
    done = run_mpi(3, [TESTS.parent / "benchmarks" / "copy_bound.py", "--sizes", "100K", "1000", "--repeats", "2",
                       "--json", out], timeout=120, via_mpi4py=False)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert sorted((r["collective"], r["bytes"]) for r in rows) == sorted(
        (c, b) for c in ("reduce_scatter", "allgather", "broadcast") for b in (100 * 1024, 1000))
    for row in rows:
        assert row["ranks"] == 3 and math.isfinite(row["cma_ms"]), row   # the ranks read each other's memory
        assert all(row[k] > 0 for k in ("floor_ms", "cma_ms", "staged_ms", "own_ms", "mpi_ms", "auto_ms")), row
        bound = {"reduce_scatter": row["floor_ms"],
                 "allgather": min(row["own_ms"] + row["cma_ms"], row["staged_ms"]),
                 "broadcast": min(row["cma_ms"], row["staged_ms"])}[row["collective"]]
        assert row["bound_over_mpi"] * row["mpi_ms"] == pytest.approx(bound)
        assert row["auto_over_mpi"] * row["mpi_ms"] == pytest.approx(row["auto_ms"])
    assert "bound/mpi" in done.stdout
