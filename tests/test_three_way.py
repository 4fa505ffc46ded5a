"""``benchmarks/three_way.py`` joins the MPICH and Open MPI runs into one table per rank count."""
import importlib.util
import json

from conftest import TESTS

BENCHMARKS = TESTS.parent / "benchmarks"


def load_three_way():
    """The script as a module (it finds ``openmpi_env`` beside itself)."""
    spec = importlib.util.spec_from_file_location("three_way", BENCHMARKS / "three_way.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(path, library, times, chosen="shared_memory"):
    """A bench --json file with one row per (algorithm, size): time."""
    rows = [{"algorithm": name, "size": size, "time_us": t, "chosen": chosen if name == "auto" else name}
            for (name, size), t in times.items()]
    path.write_text(json.dumps({"preamble": {"mpi_library": library}, "rows": rows}))


def test_medians_over_runs_best_of_ours_and_ratios(tmp_path):
    three_way = load_three_way()
    for repeat, scale in ((1, 1.0), (2, 3.0), (3, 2.0)):  # medians are the scale-2 run's values
        write_run(tmp_path / f"mpich-p4-r{repeat}.json", "MPICH Version:  5.0.2",
                  {("auto", 8): 4 * scale, ("ring", 8): 6 * scale, ("tree", 8): 3 * scale, ("mpi", 8): 8 * scale,
                   ("auto", 1024): 300 * scale, ("ring", 1024): 200 * scale, ("mpi", 1024): 100 * scale})
        write_run(tmp_path / f"openmpi-p4-r{repeat}.json", "Open MPI v5.0.11, package: Open MPI",
                  {("auto", 8): 5 * scale, ("mpi", 8): 2 * scale, ("auto", 1024): 250 * scale, ("mpi", 1024): 500 * scale})
    text = three_way.summarize(tmp_path)
    assert "### 4 ranks: 3 MPICH and 3 Open MPI runs" in text
    assert "MPICH: MPICH Version: 5.0.2" in text
    assert "| 8 | 8.00 (shared_memory) | 6.00 (tree) | 16.00 | 4.00 | 0.50x | 2.00x | 10.00 |" in text
    assert "| 1024 | 600 (shared_memory) | 400 (ring) | 200 | 1,000 | 3.00x | 0.60x | 500 |" in text


def test_a_rank_count_without_open_mpi_runs_has_no_table(tmp_path):
    three_way = load_three_way()
    write_run(tmp_path / "mpich-p2-r1.json", "MPICH", {("auto", 8): 1.0, ("mpi", 8): 2.0})
    assert "### 2 ranks" not in three_way.summarize(tmp_path)
