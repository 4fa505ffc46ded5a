"""``reduce_scatter``, ``allgather`` and ``broadcast`` on the emulated cluster (``test_cluster.py``'s
three nodes): their node-aware ``hierarchical`` and ``auto`` match MPI's own calls across isolated
nodes with uneven ranks, in blocks and round-robin (``cluster/collectives_check.py``), and the
bench's ``--collective`` reports "link %" with what each node must move.

Skipped, with the reason, where the cluster cannot be made (``test_cluster.py``).
"""
import json

import pytest

from test_cluster import PYTHON, TESTS, needs_cluster, nodes, run  # noqa: F401  (nodes: the fixture)

CHECK = ["-m", "mpi4py", str(TESTS / "cluster" / "collectives_check.py")]


@needs_cluster
@pytest.mark.parametrize("layout", [
    ["-n", "5", "--ranks-per-node", "1,2,2"],
    ["-n", "5", "--placement", "round-robin"],
], ids=["1+2+2-block", "2+2+1-round-robin"])
def test_hierarchical_collectives_across_nodes(nodes, layout):  # noqa: F811
    done = run(*layout, "--", PYTHON, *CHECK)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert done.stdout.startswith("passed: "), done.stdout + done.stderr


@needs_cluster
def test_bench_of_a_collective_shows_the_link(nodes, tmp_path):  # noqa: F811
    out = tmp_path / "bench.json"
    done = run("-n", "4", "--nodes", "2", "--", PYTHON, "-m", "allreduce_kit.bench", "--collective", "allgather",
               "-b", "1M", "-e", "1M", "-n", "2", "-w", "1", "--batch", "1", "-a", "auto,mpi", "--json", str(out))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "# nodes: 2 (node1, node2), ranks per node: 2, 2" in done.stdout
    assert "link % = (N-1)/N x size / time / link bandwidth, N = 2 nodes" in done.stdout
    rows = {r["algorithm"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["auto"]["chosen"] == "hierarchical" and rows["auto"]["wrong"] == 0
    for row in rows.values():  # 4 Gbit/s, the rate the cluster shapes to (not measured here)
        assert row["link_pct"] == pytest.approx(100 * row["size"] / 2 * 8 / (row["time_us"] * 1e-6) / 4e9)
