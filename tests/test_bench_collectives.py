"""``python -m allreduce_kit.bench --collective reduce_scatter|allgather|broadcast``: every
algorithm of the collective beside MPI's own call, nccl-tests' size and busbw for each, nothing
wrong, ``--json`` rows; options that make no sense for the collective exit 2 with one message.
"""
import json

import pytest

from allreduce_kit.bench.collectives import available, bus_factor
from conftest import TESTS  # noqa: F401  (the working directory the fixture runs in)
from test_bench import BENCH, QUICK, ok, table_rows


def test_bus_bandwidth_follows_nccl_tests():
    assert bus_factor("reduce_scatter", 4) == bus_factor("allgather", 4) == 0.75
    assert bus_factor("broadcast", 4) == 1.0


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "broadcast"])
def test_every_algorithm_beside_mpi_nothing_wrong(mpirun, tmp_path, collective):
    out = tmp_path / "rows.json"
    extra = ["--root", "2"] if collective == "broadcast" else ["-o", "max"] if collective == "reduce_scatter" else []
    result = ok(mpirun(3, BENCH + ["--collective", collective, "-b", "4", "-e", "64K", "-f", "128", *QUICK, *extra,
                                   "--json", out], timeout=300))
    rows = table_rows(result.stdout)
    names = {r[4].split("(")[0] for r in rows}
    assert names == set(available(collective)), names
    assert all(r[-1] == "0" for r in rows), "every algorithm agrees with MPI"
    assert f"faster than MPI's own" in result.stdout
    data = json.loads(out.read_text())
    assert data["preamble"]["collective"] == collective and data["wrong_total"] == 0
    for row in data["rows"]:
        factor = 1.0 if collective == "broadcast" else 2 / 3
        assert row["busbw"] == pytest.approx(row["algbw"] * factor)
        assert row["size"] in (4, 512, 65536) and row["ranks"] == 3
    if collective == "reduce_scatter":
        assert {r["op"] for r in data["rows"]} == {"max"}


def test_reduce_scatter_with_compression_checks_its_16_bit_rows_against_mpis_result_rounded(mpirun, tmp_path):
    out = tmp_path / "rows.json"
    result = ok(mpirun(3, BENCH + ["--collective", "reduce_scatter", "--compression", "bf16", "-o", "mean", "-b", "1K",
                                   "-e", "1K", *QUICK, "--json", out], timeout=300))
    assert "# compression bf16: every row but mpi sends 16-bit values" in result.stdout
    data = json.loads(out.read_text())
    assert data["preamble"]["compression"] == "bf16" and data["wrong_total"] == 0
    assert {(r["algorithm"], r["chosen"], r["compression"]) for r in data["rows"]} == {
        ("hierarchical", "hierarchical", "bf16"), ("ring", "ring", "bf16"), ("auto", "ring", "bf16"),
        ("mpi", "mpi", "none")}


@pytest.mark.parametrize("bad, words", [
    (["--collective", "gather"], "--collective"),
    (["--collective", "allgather", "--compression", "fp16"], "--compression fp16 cannot go with --collective"),
    (["--collective", "reduce_scatter", "--compression", "fp16", "-a", "pairwise"], "'pairwise'"),
    (["--collective", "allgather", "-a", "ring,two_shot"], "'two_shot'"),
    (["--collective", "allgather", "-o", "max"], "-o/--op"),
    (["--collective", "broadcast", "--root", "5"], "--root"),
    (["--root", "1"], "--root is for --collective broadcast only"),
    (["--collective", "reduce_scatter", "--tune"], "--tune is for --collective allreduce only"),
])
def test_bad_options_exit_2_with_one_message(mpirun, bad, words):
    result = mpirun(2, BENCH + bad, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("error:") == 1, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr
