"""``python -m allreduce_kit.train`` as users run it: under mpiexec, small and quick.

Each test starts at most 3 ranks on the bundled digits with a small model for one to three
epochs. Nothing here compares timings: ``benchmarks/`` measures them.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import TESTS

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
    assert png.stat().st_size > 10_000
    alone = report["allreduce_alone"]
    assert alone["calls"] == 5 and alone["transfer_ms_p50"] > 0 and alone["bare_loop_transfer_ms_p50"] > 0
    assert "alone back to back" in text
    for column in ("compute p50", "compute p95", "allreduce p50", "wait p50", "slowest", "score"):
        assert column in text


def _step_times(mpirun, tmp_path, name, extra):
    path = tmp_path / f"{name}.json"
    _ok(mpirun(3, TRAIN + SMALL + ["--epochs", "1", "--progress", "lines", "--json", path] + extra, timeout=120))
    return json.loads(path.read_text())["straggler"]


def test_injected_straggler_is_named(mpirun, tmp_path):
    """(How much the straggler slows every rank is measured by benchmarks/straggler.py.)"""
    slow = _step_times(mpirun, tmp_path, "slow", ["--straggler", "1:40"])
    assert slow["slowest_rank"] == 1
    assert [row["rank"] for row in slow["ranks"]] == [0, 1, 2]


def test_resume_reaches_the_same_parameters_as_an_uninterrupted_run(mpirun, tmp_path):
    common = TRAIN + SMALL + ["--epochs", "2", "--progress", "lines", "--jitter-ms", "1"]
    _ok(mpirun(2, common + ["--json", tmp_path / "whole.json"], timeout=120))
    ckpt = tmp_path / "ckpt"
    _ok(mpirun(2, common + ["--max-steps", "60", "--checkpoint-dir", ckpt, "--checkpoint-every", "25",
                            "--keep-checkpoints", "2"], timeout=120))
    assert sorted(os.listdir(ckpt)) == ["checkpoint-000000050.npz", "checkpoint-000000060.npz"]
    resumed = _ok(mpirun(2, common + ["--checkpoint-dir", ckpt, "--resume", "--json", tmp_path / "resumed.json"],
                         timeout=120))
    assert "resumed at step 60" in resumed.stdout
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("whole.json", "resumed.json"))
    assert a["steps"] == b["steps"] > 60
    assert a["params_digest"] == b["params_digest"]
    again = _ok(mpirun(2, common + ["--checkpoint-dir", ckpt, "--resume"], timeout=120))
    assert f"nothing to train: the checkpoint is at step {a['steps']}" in again.stdout


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


def test_a_run_imports_only_what_it_uses():
    """No scikit-learn (the digits come from its data file), plotting, progress bar, bench or parameter server."""
    probe = ("import runpy, sys\n"
             "sys.argv = ['allreduce_kit.train', '--hidden', '16', '--max-steps', '2', '--progress', 'lines']\n"
             "try:\n    runpy.run_module('allreduce_kit.train', run_name='__main__')\n"
             "except SystemExit as end:\n    assert not end.code, end.code\n"
             "print('MODULES', ' '.join(sorted(sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=TESTS)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "test accuracy" in result.stdout
    modules = set(result.stdout.split("MODULES", 1)[1].split())
    for heavy in ("sklearn", "scipy.stats", "matplotlib", "tqdm", "allreduce_kit.bench", "allreduce_kit.compare"):
        assert heavy not in modules, f"a plain training run imported {heavy}"


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path):
    fake = tmp_path / "matplotlib"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    result = _one_process(["--plot", str(tmp_path / "x.png")], env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 2
    assert "matplotlib is not installed" in result.stderr and "Traceback" not in result.stderr


def test_custom_loop_example_runs_and_is_the_one_in_the_docs(mpirun):
    root = TESTS.parent
    example = (root / "examples" / "custom_loop.py").read_text()
    doc = (root / "docs" / "custom-loop.md").read_text()
    body = example.split('"""', 2)[2].strip()
    assert body in doc, "docs/custom-loop.md no longer shows examples/custom_loop.py"
    result = _ok(mpirun(3, [root / "examples" / "custom_loop.py"], timeout=120))
    accuracy = float(result.stdout.split("test accuracy ")[1].split()[0])
    assert accuracy > 0.85 and "replicas identical: True" in result.stdout
