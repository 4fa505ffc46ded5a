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


def test_one_table_joins_every_rank_count_with_auto_under_each_mpi_over_open_mpis_time(tmp_path):
    three_way = load_three_way()
    for p, scale in ((2, 1.0), (8, 10.0)):
        write_run(tmp_path / f"mpich-p{p}-r1.json", "MPICH",
                  {("auto", 4): 3 * scale, ("mpi", 4): 5 * scale, ("auto", 1 << 20): 800 * scale,
                   ("mpi", 1 << 20): 900 * scale})
        write_run(tmp_path / f"openmpi-p{p}-r1.json", "Open MPI",
                  {("auto", 4): 2 * scale, ("mpi", 4): 4 * scale, ("auto", 1 << 20): 700 * scale,
                   ("mpi", 1 << 20): 1000 * scale})
    write_run(tmp_path / "mpich-p4-r1.json", "MPICH", {("auto", 4): 1.0, ("mpi", 4): 2.0})  # no Open MPI run
    lines = three_way.joined(tmp_path, [2, 4, 8])
    assert lines[0].startswith("| size | 2 ranks: `auto`, MPICH | `auto`, Open MPI |") and "4 ranks" not in lines[0]
    assert lines[0].count("ranks: `auto`, MPICH") == 2 and lines[1].count("---:") == 9
    assert lines[2] == "| 4 B | 3.00 (0.75x) | 2.00 (0.50x) | 5.00 | 4.00 | 30.00 (0.75x) | 20.00 (0.50x) | 50.00 | 40.00 |"
    assert lines[3] == ("| 1 MiB | 800 (0.80x) | 700 (0.70x) | 900 | 1,000 "
                        "| 8,000 (0.80x) | 7,000 (0.70x) | 9,000 | 10,000 |")
    assert "### Every rank count" in three_way.summarize(tmp_path)
