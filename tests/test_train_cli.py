"""``python -m allreduce_kit.train`` as users run it: under mpiexec, small and quick.

Each test starts at most 3 ranks on the bundled digits with a small model for one to three
epochs. Nothing here compares timings: ``benchmarks/`` measures them.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from allreduce_kit.algorithms import ALGORITHMS
from allreduce_kit.train import checkpoint
from conftest import TESTS, run_mpi

TRAIN = ["-m", "allreduce_kit.train"]
SMALL = ["--hidden", "32", "--batch-size", "16"]


def _ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def test_small_run_prints_once_and_writes_json_and_plot(mpirun, tmp_path):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    result = _ok(mpirun(3, TRAIN + SMALL + ["--epochs", "3", "--json", out, "--plot", png, "--progress", "bar",
                                              "--bench-allreduce", "5"],
                        timeout=120))
    text = result.stdout
    assert text.count("test accuracy") == 1 and text.count("epoch 3/3") == 1      # rank 0 only
    assert "replicas bitwise identical on all 3 ranks: yes" in text
    assert "step/s" in result.stderr or "step/s" in text                          # the tqdm bar
    report = json.loads(out.read_text())
    assert report["ranks"] == 3 and len(report["epochs"]) == 3
    assert report["test_accuracy"] > 0.85
    assert [r["rank"] for r in report["straggler"]["ranks"]] == [0, 1, 2]
    assert report["config"]["hidden"] == [32] and report["config"]["algorithm"] == "auto"
    for row in report["straggler"]["ranks"]:
        assert {"host", "compute_p50_ms", "compute_p95_ms", "allreduce_p50_ms", "wait_p50_ms",
                "slowest_share", "score"} <= set(row)
        # One naming scheme, quantity_unit_statistic, beside the names kept for readers of older files.
        for quantity in ("compute", "allreduce", "step", "wait"):
            assert row[f"{quantity}_ms_p50"] == row[f"{quantity}_p50_ms"]
        assert row["compute_ms_p95"] == row["compute_p95_ms"]
    straggler = report["straggler"]
    assert straggler["skew_ms_p50"] == straggler["other_ms_p50"]
    assert f"+ skew {straggler['skew_ms_p50']:.2f} ms" in text                    # the text's name is the JSON's
    # Which algorithm auto ran, per bucket, in the header and the JSON.
    ran = report["bucket_algorithms"]
    assert len(ran) == report["buckets"] == 1 and ran[0] in ALGORITHMS
    assert f"algorithm auto, ran {ran[0]}" in text
    assert f"wrote {png}" in text and png.stat().st_size > 10_000               # exactly the path it names
    alone = report["allreduce_alone"]
    assert alone["calls"] == 5 and alone["transfer_ms_p50"] > 0 and alone["bare_loop_transfer_ms_p50"] > 0
    assert "alone back to back" in text
    for column in ("compute p50", "compute p95", "allreduce p50", "wait p50", "slowest", "score"):
        assert column in text


def _step_times(mpirun, tmp_path, name, extra):
    path = tmp_path / f"{name}.json"
    _ok(mpirun(3, TRAIN + SMALL + ["--epochs", "1", "--progress", "lines", "--json", path] + extra, timeout=120))
    return json.loads(path.read_text())["straggler"]


def test_injected_straggler_is_named_by_the_report_and_by_the_trace(mpirun, tmp_path):
    """(How much the straggler slows every rank is measured by benchmarks/straggler.py.) The same run
    writes --trace for steps 2 to 21: a file that passes the schema check, holding those steps alone
    on every rank, whose summary names the straggler in at least 95% of them."""
    from allreduce_kit.trace.summary import load, summarise
    from trace_schema import problems
    trace = tmp_path / "trace.json"
    slow = _step_times(mpirun, tmp_path, "slow", ["--straggler", "1:40", "--trace", trace, "--trace-steps", "2:22"])
    assert slow["slowest_rank"] == 1
    assert [row["rank"] for row in slow["ranks"]] == [0, 1, 2]
    document = load(str(trace))
    assert problems(document) == []
    for rank in range(3):
        steps = sorted(int(e["name"].split("#")[1]) for e in document["traceEvents"]
                       if e["pid"] == rank and e["name"].startswith("ProfilerStep#"))
        assert steps == list(range(2, 22)), (rank, steps)
        named = {e["name"] for e in document["traceEvents"] if e["pid"] == rank and e["ph"] == "X"}
        assert {"forward_backward", "gradient_average", "allreduce", "update"} <= named
    summary = summarise(document)
    assert [row["name"] for row in summary["ranks"]] == [f"rank {r} ({slow['ranks'][r]['host']})" for r in range(3)]
    assert summary["ranks"][1]["slowest_steps"] >= 0.95 * 20
    assert summary["ranks"][1]["others_waited_ms"] > 2 * 20 * 30


def _history(run):
    """What a resumed run must report as the uninterrupted one does: everything but timings."""
    epochs = [{k: e[k] for k in ("epoch", "steps", "loss", "train_accuracy", "test_accuracy", "samples", "lr")}
              for e in run["epochs"]]
    summary = {k: run["summary"].get(k) for k in ("samples", "updates_applied", "loss_per_epoch", "epoch_numbers",
                                               "train_accuracy", "test_accuracy")}
    return epochs, summary, run["summary"]["curve"]["samples"], run["steps"], run["params_digest"]


def test_resume_reaches_the_same_parameters_and_history_as_an_uninterrupted_run(mpirun, tmp_path):
    """2 ranks, 45 steps per epoch. From a checkpoint inside epoch 1 (step 44), one written at the end
    of a run cut short inside epoch 2 (50) and one at an epoch's end (45), the resumed run reports
    what the uninterrupted run reports, timings aside: per-epoch records, counters, epoch numbers."""
    common = TRAIN + SMALL + ["--epochs", "2", "--progress", "lines", "--jitter-ms", "1"]
    _ok(mpirun(2, common + ["--json", tmp_path / "whole.json"], timeout=120))
    whole = json.loads((tmp_path / "whole.json").read_text())
    assert [e["epoch"] for e in whole["epochs"]] == [1, 2] and whole["steps"] == 90
    ckpt = tmp_path / "ckpt"
    _ok(mpirun(2, common + ["--max-steps", "50", "--checkpoint-dir", ckpt, "--checkpoint-every", "22",
                            "--keep-checkpoints", "2"], timeout=120))
    assert sorted(os.listdir(ckpt)) == ["checkpoint-000000044.npz", "checkpoint-000000050.npz"]
    resumed = _ok(mpirun(2, common + ["--checkpoint-dir", ckpt, "--resume", "--json", tmp_path / "resumed.json"],
                         timeout=120))
    assert "resumed at step 50" in resumed.stdout
    b = json.loads((tmp_path / "resumed.json").read_text())
    assert _history(b) == _history(whole)
    # The same from the checkpoint inside epoch 1, and one written at an epoch's end (save every 45).
    older = tmp_path / "older"
    older.mkdir()
    shutil.copy(ckpt / "checkpoint-000000044.npz", older)
    _ok(mpirun(2, common + ["--checkpoint-dir", older, "--resume", "--json", tmp_path / "from44.json"], timeout=120))
    assert _history(json.loads((tmp_path / "from44.json").read_text())) == _history(whole)
    edge = tmp_path / "edge"
    _ok(mpirun(2, common + ["--max-steps", "45", "--checkpoint-dir", edge, "--checkpoint-every", "45"], timeout=120))
    _ok(mpirun(2, common + ["--checkpoint-dir", edge, "--resume", "--json", tmp_path / "from45.json"], timeout=120))
    assert _history(json.loads((tmp_path / "from45.json").read_text())) == _history(whole)
    # compare lines the epochs up: the resumed run's epoch 2 beside the whole run's epoch 2.
    table = _ok(subprocess.run([sys.executable, "-m", "allreduce_kit.compare", tmp_path / "whole.json",
                                tmp_path / "resumed.json"], capture_output=True, text=True, timeout=60, cwd=TESTS))
    rows = {line.split("  ")[0]: line.split()[-2:] for line in table.stdout.splitlines()[2:]}
    for e in (1, 2):
        assert rows[f"loss epoch {e}"] == [f"{whole['epochs'][e - 1]['loss']:.4f}"] * 2
    again = _ok(mpirun(2, common + ["--checkpoint-dir", ckpt, "--resume"], timeout=120))
    assert f"nothing to train: the checkpoint is at step {whole['steps']}" in again.stdout


def _in_one_job(tmp_path, name, cases, ranks=2):
    """Run each command line of ``cases`` in turn in one MPI job (``bad_options_driver.py``); per case,
    every rank's record: exit status, stdout, stderr, and what it raised besides ``SystemExit``."""
    listed, out = tmp_path / f"{name}.json", tmp_path / f"{name}-out.json"
    listed.write_text(json.dumps([[str(a) for a in argv] for argv in cases]))
    result = run_mpi(ranks, [TESTS / "bad_options_driver.py", listed, out], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


def _refused(ranks, message):
    """One message from rank 0, status 2 on every rank, no traceback."""
    for record in ranks:
        assert record["raised"] is None and record["status"] == 2, record
        assert "Traceback" not in record["stdout"] + record["stderr"]
    assert ranks[0]["stderr"].count(message) == 1 and ranks[0]["stderr"].count("error:") == 1, ranks[0]["stderr"]
    assert all(record["stderr"] == "" for record in ranks[1:])


def test_a_run_keeps_to_its_own_checkpoints_in_a_directory_another_run_used(tmp_path):
    """A directory holding an older run's checkpoint-000000240.npz: a fresh run there is refused up
    front, naming --resume and another directory, whether the older run is another one (here --seed 1)
    or the same one run again; --resume in a directory holding both runs' checkpoints continues this
    run's newest, says which, leaves the other's alone (keep-newest-K deletes only this run's) and
    refuses to reach a step where it would write over the other's. A checkpoint that records no
    identity has it worked out from the configuration it records, or is refused as unknown."""
    ck, mine, legacy = tmp_path / "ck", tmp_path / "mine", tmp_path / "legacy"
    legacy.mkdir()
    checkpoint.save(str(legacy), 8, {"params": np.zeros(3)}, {"ranks": 2})      # no identity, no configuration
    quick = SMALL + ["--progress", "lines"]
    other = quick + ["--seed", "1"]
    fresh = ["--checkpoint-every", "10", "--max-steps", "30"]
    first = _in_one_job(tmp_path, "first", [
        other + ["--checkpoint-dir", ck, "--max-steps", "240", "--checkpoint-every", "240"],
        quick + ["--checkpoint-dir", ck] + fresh,                                  # the command line
        other + ["--checkpoint-dir", ck] + fresh,                                  # the older run's, again
        quick + ["--checkpoint-dir", mine] + fresh,
        quick + ["--checkpoint-dir", legacy] + fresh])
    assert [ranks[0]["status"] for ranks in first] == [0, 2, 2, 0, 2], [r[0]["stderr"] for r in first]
    _refused(first[1], f"argument --checkpoint-dir: {ck} holds checkpoints of another run "
                       f"(checkpoint-000000240.npz, step 240: --seed 1 where this run has --seed 0); this run would "
                       f"mix its own in with them and delete the oldest: give it another directory or --resume with "
                       f"that run's settings to continue it")
    _refused(first[2], f"argument --checkpoint-dir: {ck} holds checkpoints of this run (the same --mode, data, --seed "
                       f"and model; newest checkpoint-000000240.npz, step 240); a fresh run would mix its own in with "
                       f"them: --resume continues from checkpoint-000000240.npz; to start over, give it another "
                       f"directory")
    _refused(first[4], f"argument --checkpoint-dir: {legacy} holds checkpoints whose run cannot be told "
                       f"(checkpoint-000000008.npz, step 8: its record names no run)")
    assert sorted(os.listdir(ck)) == ["checkpoint-000000240.npz"]               # nothing mixed in
    assert sorted(os.listdir(mine)) == [checkpoint.name_for(s) for s in (10, 20, 30)]
    # A directory that holds both runs' checkpoints, and one whose newest records no identity.
    shutil.copy(ck / "checkpoint-000000240.npz", mine)
    stripped = tmp_path / "stripped"
    arrays, meta = checkpoint.load(str(mine / checkpoint.name_for(30)))
    checkpoint.save(str(stripped), 30, arrays, {k: v for k, v in meta.items() if k not in ("run", "run_settings")})
    second = _in_one_job(tmp_path, "second", [
        quick + ["--checkpoint-dir", mine, "--resume", "--max-steps", "30"],
        quick + ["--checkpoint-dir", mine, "--resume", "--max-steps", "300"],
        quick + ["--checkpoint-dir", mine, "--resume", "--max-steps", "40"],
        other + ["--checkpoint-dir", mine, "--resume", "--max-steps", "240"],
        quick + ["--checkpoint-dir", stripped, "--resume", "--max-steps", "40"]])
    assert [ranks[0]["status"] for ranks in second] == [0, 2, 0, 0, 0], [r[0]["stderr"] for r in second]
    text = second[0][0]["stdout"]
    assert f"resumed at step 30 from {mine / checkpoint.name_for(30)}" in text, text
    assert (f"--resume: left alone 1 checkpoint of another run in {mine} (the newest checkpoint-000000240.npz, step "
            f"240: --seed 1 where this run has --seed 0)") in text
    assert "nothing to train: the checkpoint is at step 30 and this run ends at step 30" in text
    _refused(second[1], f"--resume: {mine} also holds checkpoints of another run at steps this run reaches, which "
                        f"its own would write over (240; checkpoint-000000240.npz: --seed 1 where this run has --seed 0)")
    assert f"resumed at step 30 from {mine / checkpoint.name_for(30)}" in second[2][0]["stdout"]
    assert "test accuracy" in second[2][0]["stdout"]
    assert sorted(os.listdir(mine)) == [checkpoint.name_for(s) for s in (20, 30, 40, 240)]   # K = 3 of its own
    text = second[3][0]["stdout"]
    assert f"resumed at step 240 from {mine / checkpoint.name_for(240)}" in text and "nothing to train" in text
    assert f"left alone 3 checkpoints of another run in {mine} (the newest checkpoint-000000040.npz" in text
    text = second[4][0]["stdout"]
    assert f"resumed at step 30 from {stripped / checkpoint.name_for(30)}" in text and "test accuracy" in text
    assert checkpoint.load(checkpoint.latest(str(stripped)))[1]["run"] == meta["run"]


@pytest.mark.parametrize("args,message", [
    (["--batch-size", "0"], "argument --batch-size: must be >= 1"),
    (["--straggler", "5:10"], "argument --straggler: rank 5 does not exist"),
    (["--hidden", "12,x"], "argument --hidden"),
    (["--resume", "--checkpoint-dir", "NOWHERE"], "--resume: no checkpoint in NOWHERE"),
])
def test_bad_options_give_one_message_and_exit_2(mpirun, args, message):
    result = mpirun(2, TRAIN + args, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count(message) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def _one_process(args, env=None, cwd=TESTS):
    return subprocess.run([sys.executable, *TRAIN, *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **(env or {})), cwd=cwd)


def test_help_lists_every_option_with_its_default():
    result = _one_process(["--help"])
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for option in ("--epochs", "--batch-size", "--lr", "--hidden", "--dataset", "--algorithm", "--seed",
                   "--bucket-mb", "--lr-scaling", "--warmup-epochs", "--straggler", "--jitter-ms", "--json",
                   "--plot", "--checkpoint-dir", "--checkpoint-every", "--resume", "--samples", "--features",
                   "--classes", "--momentum", "--weight-decay", "--gather-every",
                   "--stall-timeout", "--keep-checkpoints", "--on-nonfinite", "--inject-nan"):
        assert option in text, option
    assert "(0: off) (default: $ALLREDUCE_KIT_STALL_TIMEOUT, else 60)" in text and "(default: abort)" in text
    assert "(default: 40)" in text and "(default: auto)" in text and "(default: digits)" in text


def test_a_one_rank_run_says_what_it_did_in_words_and_records_every_option(tmp_path):
    """Singular nouns for 1, the whole run's wall time, and every option in the config (null where it
    does not apply)."""
    out = tmp_path / "one.json"
    begun = time.perf_counter()
    result = _one_process(["--hidden", "8", "--max-steps", "1", "--progress", "lines", "--gather-every", "1",
                           "--json", str(out)])
    elapsed = time.perf_counter() - begun
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = result.stdout
    assert "1 rank on 1 host" in text and "after 1 step |" in text and "straggler report over 1 step " in text
    assert "summary (sync, 1 rank," in text and "1 update applied" in text
    assert not re.search(r"\b1 (ranks|hosts|steps|buckets|updates|gradients|calls)\b", text), text
    report = json.loads(out.read_text())
    summary = report["summary"]
    # Wall time: the whole command (start-up, data, warm-up, training), not only the epochs' loop.
    assert summary["train_seconds"] == sum(e["seconds"] for e in report["epochs"])
    assert summary["train_seconds"] < summary["wall_seconds"] <= elapsed
    from allreduce_kit.train.__main__ import build_parser
    options = {a.dest for a in build_parser()._actions if a.dest not in ("help", "version")}
    config = report["config"]
    assert options <= set(config), options - set(config)
    assert config["json"] == str(out) and config["progress"] == "lines" and config["stall_timeout"] == 60.0
    assert config["max_steps"] == 1 and config["gather_every"] == 1
    for idle in ("servers", "max_staleness", "worker_timeout", "inject_fault",   # --mode async-ps only
                 "samples", "features", "classes",                              # synthetic only
                 "checkpoint_every", "keep_checkpoints",                        # --checkpoint-dir only
                 "warmup_epochs"):                                              # --lr-scaling linear only
        assert config[idle] is None, idle


def test_a_run_imports_only_what_it_uses():
    """No scikit-learn (the digits come from its data file), no scipy.linalg (which numba's set-up
    imports to look for BLAS the package's compiled code does not use), plotting, progress bar,
    bench or parameter server."""
    probe = ("import runpy, sys\n"
             "sys.argv = ['allreduce_kit.train', '--hidden', '16', '--max-steps', '2', '--progress', 'lines']\n"
             "try:\n    runpy.run_module('allreduce_kit.train', run_name='__main__')\n"
             "except SystemExit as end:\n    assert not end.code, end.code\n"
             "print('MODULES', ' '.join(sorted(sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=TESTS)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "test accuracy" in result.stdout
    modules = set(result.stdout.split("MODULES", 1)[1].split())
    for heavy in ("sklearn", "scipy.linalg", "matplotlib", "tqdm", "allreduce_kit.bench", "allreduce_kit.compare"):
        assert heavy not in modules, f"a plain training run imported {heavy}"


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path):
    fake = tmp_path / "matplotlib"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    result = _one_process(["--plot", str(tmp_path / "x.png")], env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 2
    assert "matplotlib is not installed" in result.stderr and "Traceback" not in result.stderr
    assert 'pip install ".[plot]"' in result.stderr, result.stderr     # what the docs say, from a checkout


def test_custom_loop_example_runs_and_is_the_one_in_the_docs(mpirun):
    root = TESTS.parent
    example = (root / "examples" / "custom_loop.py").read_text()
    doc = (root / "docs" / "custom-loop.md").read_text()
    body = example.split('"""', 2)[2].strip()
    assert body in doc, "docs/custom-loop.md no longer shows examples/custom_loop.py"
    result = _ok(mpirun(3, [root / "examples" / "custom_loop.py"], timeout=120))
    accuracy = float(result.stdout.split("test accuracy ")[1].split()[0])
    assert accuracy > 0.85 and "replicas identical: True" in result.stdout
