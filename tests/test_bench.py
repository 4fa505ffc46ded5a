"""``python -m allreduce_kit.bench`` as a user runs it: under mpiexec, small sizes, few samples.

The bench's speed claims live in docs/performance.md; these tests check what it prints and
writes, that every algorithm agrees with MPI (``#wrong`` is 0), and that bad options fail once,
cleanly, with status 2.
"""
import csv
import json
import os

import pytest

from allreduce_kit import selection
from allreduce_kit.bench.sweep import available
from conftest import TESTS, run_mpi, unwritable_folder

BENCH = ["-m", "allreduce_kit.bench"]
QUICK = ["-n", "2", "-w", "1"]
COLUMNS = ("size(B)", "count", "type", "op", "algorithm", "time(us)", "min", "max", "algbw(GB/s)", "busbw(GB/s)",
           "#wrong")


def table_rows(stdout: str):
    """The table's data lines: rank 0's only, split into fields (the '|' separators dropped)."""
    return [[f for f in line.split() if f != "|"] for line in stdout.splitlines()
            if line.strip() and not line.startswith("#")]


def ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def test_table_json_and_csv_at_three_ranks(mpirun, tmp_path):
    """Three ranks (not a power of two): every algorithm, every size, nothing wrong, one table."""
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    result = ok(mpirun(3, BENCH + ["-b", "4", "-e", "64K", "-f", "64", *QUICK, "--json", out_json, "--csv", out_csv],
                       timeout=240))
    header = [line for line in result.stdout.splitlines() if "size(B)" in line and "algorithm" in line]
    assert len(header) == 1, "one table, printed by rank 0 only"
    assert [c for c in header[0].lstrip("#").split() if c != "|"] == list(COLUMNS)
    assert "3 ranks" in result.stdout and "MPI:" in result.stdout
    rows = table_rows(result.stdout)
    sizes = [4, 256, 16384]
    assert len(rows) == len(sizes) * len(available())
    for fields in rows:
        assert len(fields) == len(COLUMNS), fields
        assert fields[2] == "float32" and fields[3] == "sum"
        assert int(fields[-1]) == 0, f"#wrong must be 0: {fields}"
        assert float(fields[5]) > 0 and float(fields[6]) <= float(fields[5]) <= float(fields[7])
    assert any(f[4].startswith("auto(") for f in rows), "auto shows what it chose"
    assert "best/mpi" in result.stdout
    assert "auto tunes online: on" in result.stdout

    payload = json.loads(out_json.read_text())
    assert payload["preamble"]["ranks"] == 3
    transport = "direct reads and writes" if payload["preamble"]["direct_transfers"] else "messages"
    assert f"ring, rabenseifner and two_shot move data by {transport}" in result.stdout, "the preamble says how data moved"
    assert {r["algorithm"] for r in payload["rows"]} == set(available())
    assert sorted({r["size"] for r in payload["rows"]}) == sizes
    assert all(r["wrong"] == 0 and r["ranks"] == 3 for r in payload["rows"])
    assert payload["preamble"]["online_tuning"] == "on"
    for r in (r for r in payload["rows"] if r["algorithm"] == "auto"):  # timed after exploring, on its winner
        assert r["trials"]["algorithm"] == r["chosen"] and r["chosen"] in r["trials"]["times_us"], r
        assert r["explored"] + 1 == r["trials"]["exploration_calls"] == r["trials"]["calls_exploring"], r
    for r in payload["rows"]:
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * 2 / 3)
        assert r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3)
    with open(out_csv, newline="") as handle:
        assert len(list(csv.DictReader(handle))) == len(payload["rows"])
    # nccl-tests' closing lines: no wrong value, and the mean bus bandwidth over the sizes per algorithm.
    assert "# Out of bounds values : 0 OK" in result.stdout
    closing = [line for line in result.stdout.splitlines() if line.startswith("# Avg bus bandwidth    : ")]
    assert len(closing) == len(available())
    for name in available():
        mean = sum(r["busbw"] for r in payload["rows"] if r["algorithm"] == name) / len(sizes)
        assert payload["avg_busbw"][name] == pytest.approx(mean)
        line = next(line for line in closing if f"({name}," in line)
        assert float(line.split(":")[1].split()[0]) == pytest.approx(mean, rel=1e-5)
    assert f"# wrote {out_json}" in result.stdout and f"# wrote {out_csv}" in result.stdout
    options = payload["preamble"]["options"]                      # every option, under its name
    assert options["json"] == str(out_json) and options["csv"] == str(out_csv) and options["plot"] is None
    assert options["minbytes"] == "4" and options["stepfactor"] == 64 and options["stall_timeout"] == 60.0


def test_numpy_kernels_mean_of_integers_is_right(mpirun):
    """``--kernel numpy`` swaps the reduction step; a mean of int32 (truncating) still matches MPI."""
    result = ok(mpirun(2, BENCH + ["-b", "64", "-e", "4K", "-f", "64", "-d", "int32", "-o", "mean", "--kernel", "numpy",
                                   "-a", "ring,rabenseifner,recursive_doubling,mpi", *QUICK], timeout=180))
    assert "reduction kernels: numpy" in result.stdout
    assert "ring, rabenseifner and two_shot move data by messages" in result.stdout, "direct paths fold in compiled code only"
    rows = table_rows(result.stdout)
    assert len(rows) == 2 * 4 and all(r[2] == "int32" and r[3] == "mean" and r[-1] == "0" for r in rows)


def test_tune_writes_a_file_that_auto_then_reads(mpirun, tmp_path):
    """MPI's own Allreduce competes too, timed through allreduce() as auto would call it."""
    tuning, out, tuned = tmp_path / "tuning.json", tmp_path / "auto.json", tmp_path / "tune.json"
    ok(mpirun(2, BENCH + ["-b", "4", "-e", "1M", "-f", "32", *QUICK, "-a", "recursive_doubling,ring,tree,mpi",
                          "--tune", tuning, "--json", tuned], timeout=240))
    table = selection.parse(json.loads(tuning.read_text()))
    assert list(table) == [2] and table[2][0][0] == 0
    assert {name for _, name in table[2]} <= {"recursive_doubling", "ring", "tree", "mpi"}
    assert json.loads(tuned.read_text())["preamble"]["mpi_row"].startswith("allreduce(algorithm='mpi')")

    ok(mpirun(2, BENCH + ["-b", "4", "-e", "1M", "-f", "32", *QUICK, "-a", "auto", "--json", out],
           env={selection.ENV: str(tuning)}, timeout=180))
    payload = json.loads(out.read_text())
    lo, hi = table.ranges[2]                                  # the sizes the tune measured
    assert (lo, hi) == (4, 131072)                            # -b 4 -e 1M -f 32: 4 B ... 128 KiB
    assert payload["preamble"]["auto_table"] == f"{tuning} for {lo} B to {hi} B; built-in elsewhere"
    auto = selection.auto_from(table, str(tuning), 2)
    for row in payload["rows"]:
        assert row["chosen"] == auto.choose(row["size"]) == selection.choose(row["size"], 2, table), row


def test_auto_follows_a_hand_written_tuning_file(mpirun, tmp_path):
    """A file that says 'tree below 1 KiB, naive from there' is obeyed, size by size."""
    tuning = tmp_path / "mine.json"
    tuning.write_text(json.dumps({"format": 1, "rules": {"2": [[0, "tree"], [1024, "naive"]]}}))
    result = ok(mpirun(2, BENCH + ["-b", "256", "-e", "4K", "-f", "4", *QUICK, "-a", "auto"],
                       env={selection.ENV: str(tuning)}, timeout=120))
    chosen = {int(r[0]): r[4] for r in table_rows(result.stdout)}
    assert chosen == {256: "auto(tree)", 1024: "auto(naive)", 4096: "auto(naive)"}


def test_fit_prints_parameters_from_a_run_and_from_files(mpirun, tmp_path):
    out = tmp_path / "p2.json"
    result = ok(mpirun(2, BENCH + ["-b", "8", "-e", "256K", "-f", "8", *QUICK, "-a", "recursive_doubling,ring,tree",
                                   "--json", out, "--fit"], timeout=180))
    assert "alpha =" in result.stdout and "beta =" in result.stdout and "gamma =" in result.stdout
    assert json.loads(out.read_text())["fit"]["points"] == 6 * 3  # 8 B to 256 KiB by 8: six sizes

    fitted = tmp_path / "fit.json"
    result = ok(mpirun(1, BENCH + ["--fit", out, "--json", fitted], timeout=120))
    assert result.stdout.count("alpha =") == 2  # the joint fit and p = 2 alone
    assert "predicted" in result.stdout
    params = json.loads(fitted.read_text())
    assert {"alpha", "beta", "gamma"} <= set(params["fit"]) and len(params["predicted"]) == 18


@pytest.mark.parametrize("bad, words", [
    (["-b", "1M", "-e", "4"], "-b/--minbytes"),
    (["-b", "lots"], "-b/-e"),
    (["-f", "1"], "-f/--stepfactor"),
    (["-n", "0"], "-n/--iters"),
    (["-a", "ring,bogus"], "'bogus'"),
    (["-d", "float16"], "-d/--datatype"),
    (["--fit", "/nonexistent/rows.json"], "/nonexistent/rows.json"),
    (["--json", "/nonexistent/out.json"], "--json"),
    (["-a", "auto", "--tune", "/tmp/never-written.json"], "--tune"),
    (["--overlap", "lots"], "--overlap"),
    (["--overlap", "--compute-ms", "0"], "--compute-ms"),
    (["--overlap", "--tune", "/tmp/never-written.json"], "--overlap"),
])
def test_bad_options_exit_2_with_one_message(mpirun, bad, words):
    result = mpirun(2, BENCH + bad, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("error:") == 1, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr


def test_overlap_times_the_pair_against_each_alone(mpirun, tmp_path):
    """``--overlap``: per method, compute alone, the collective alone, both, and their ratio;
    ``mpi`` is MPI's own Iallreduce."""
    out = tmp_path / "overlap.json"
    result = ok(mpirun(2, BENCH + ["--overlap", "64K", "--compute-ms", "2", *QUICK, "-a", "auto,ring,mpi",
                                   "--json", out], timeout=240))
    assert "ratio" in result.stdout and "MPI Iallreduce, polled" in result.stdout
    payload = json.loads(out.read_text())
    assert payload["preamble"]["ranks"] == 2 and payload["preamble"]["size"] == 65536
    rows = payload["overlap"]
    assert [r["algorithm"] for r in rows] == ["auto", "ring", "mpi"]
    for row in rows:
        assert row["size"] == 65536 and row["compute_ms"] > 0 and row["collective_ms"] > 0 and row["both_ms"] > 0
        assert row["ratio"] == pytest.approx(row["both_ms"] / max(row["compute_ms"], row["collective_ms"]))


def test_a_broken_tuning_file_is_an_input_error(mpirun, tmp_path):
    tuning = tmp_path / "broken.json"
    tuning.write_text('{"rules": {"2": [[0, "warp_drive"]]}}')
    result = mpirun(2, BENCH + ["-b", "4", "-e", "4", *QUICK], env={selection.ENV: str(tuning)}, timeout=120)
    assert result.returncode == 2 and result.stderr.count("error:") == 1 and "warp_drive" in result.stderr
    assert "Traceback" not in result.stderr


def test_every_output_path_is_checked_before_measuring(tmp_path):
    """Each case in one 2-rank job: one message from rank 0 naming the option and the path, status 2,
    and nothing measured (without the check each would measure, then lose the results)."""
    folder = tmp_path / "a-folder"
    folder.mkdir()
    afile = tmp_path / "a-file"
    afile.write_text("not a tuning file")
    locked = unwritable_folder(tmp_path)
    tiny = ["-b", "4", "-e", "4", "-n", "1", "-w", "1", "-a", "mpi"]
    cases = [
        (["--json", str(folder)], f"argument --json: {folder} is a directory"),
        (["--csv", str(folder) + os.sep], f"argument --csv: {folder}{os.sep} is a directory"),
        (["--csv", "/no/such/dir/rows.csv"], "argument --csv: directory /no/such/dir does not exist"),
        (["--json", str(locked / "r.json")], f"argument --json: cannot write {locked / 'r.json'}: Permission denied"),
        (["--plot", str(tmp_path / "bandwidth")], f"argument --plot: {tmp_path / 'bandwidth'} does not end in .png"),
        (["--plot", str(folder / "x.png"), "--json", str(folder / "x.png")],
         f"argument --plot: {folder / 'x.png'} is also the path of --json"),
        (["--tune", str(folder)], f"argument --tune: {folder} is a directory"),
        (["--tune", str(afile)], f"argument --tune: {afile} is there and is not a tuning file to add to"),
        (["--tune", str(afile / "t.json")], f"argument --tune: cannot write {afile / 't.json'}: {afile} is not a directory"),
        (["--fit", str(afile), "--json", str(folder)], f"argument --json: {folder} is a directory"),
        (["--trace", str(folder)], f"argument --trace: {folder} is a directory"),
        (["--trace", "/no/such/dir/t.json"], "argument --trace: directory /no/such/dir does not exist"),
    ]
    (tmp_path / "cases.json").write_text(json.dumps([tiny + argv for argv, _ in cases]))
    result = run_mpi(2, [TESTS / "bad_options_driver.py", tmp_path / "cases.json", tmp_path / "out.json",
                         "allreduce_kit.bench"], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for (argv, message), ranks in zip(cases, json.loads((tmp_path / "out.json").read_text())):
        for rank, record in enumerate(ranks):
            assert record["raised"] is None and record["status"] == 2, (argv, rank, record)
            assert "Traceback" not in record["stderr"] and record["stdout"] == "", (argv, record)
        assert ranks[0]["stderr"].count(message) == 1 and ranks[0]["stderr"].count("error:") == 1, (argv, ranks[0])
        assert ranks[1]["stderr"] == ""
    assert sorted(p.name for p in folder.iterdir()) == [] and afile.read_text() == "not a tuning file"


def test_plot_and_trace_write_exactly_the_paths_they_name(mpirun, tmp_path):
    """--trace: one file of both ranks' timed calls, each named with its algorithm and bytes."""
    from trace_schema import problems
    png, trace = tmp_path / "bandwidth.png", tmp_path / "trace.json"
    result = ok(mpirun(2, BENCH + ["-b", "16", "-e", "64", "-f", "4", *QUICK, "-a", "ring,mpi", "--plot", png,
                                   "--trace", trace], timeout=120))
    assert f"# wrote {png}" in result.stdout and f"# wrote {trace} (" in result.stdout
    assert sorted(os.listdir(tmp_path)) == ["bandwidth.png", "trace.json"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads(trace.read_text())
    assert problems(document) == []
    for rank in (0, 1):
        calls = [e for e in document["traceEvents"] if e["pid"] == rank and e.get("cat") == "collective"]
        assert {(e["args"]["algorithm"], e["args"]["bytes"]) for e in calls} >= {("ring", 16), ("ring", 64)}


def test_with_online_tuning_off_auto_is_timed_on_its_table(mpirun, tmp_path):
    out = tmp_path / "off.json"
    result = ok(mpirun(2, BENCH + ["-b", "4", "-e", "64K", "-f", "128", *QUICK, "-a", "auto", "--json", out],
                       env={"ALLREDUCE_KIT_ONLINE_TUNING": "0", selection.ENV: "builtin"}, timeout=120))
    assert "auto tunes online: off" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["chosen"], r["explored"], r["trials"]) for r in rows] == [
        (selection.choose(r["size"], 2), 0, None) for r in rows]


def test_saving_online_results_with_the_builtin_table_is_an_input_error(mpirun):
    result = mpirun(2, BENCH + ["-b", "4", "-e", "4", *QUICK],
                    env={"ALLREDUCE_KIT_ONLINE_TUNING": "save", selection.ENV: "builtin"}, timeout=120)
    assert result.returncode == 2 and result.stderr.count("error:") == 1, result.stdout + result.stderr
    assert "ALLREDUCE_KIT_ONLINE_TUNING=save needs a tuning file" in result.stderr and "Traceback" not in result.stderr
