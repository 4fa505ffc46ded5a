"""The CLIs take settings in one order, CLI flag > environment > default, and refuse a bad
setting up front: one message from rank 0, exit status 2, no traceback."""
import json

import pytest

TRAIN = ["-m", "allreduce_kit.train", "--hidden", "16", "--max-steps", "2"]


def _stall_timeout_in_json(mpirun, tmp_path, env, extra=()):
    out = tmp_path / "run.json"
    result = mpirun(2, [*TRAIN, *extra, "--json", out], timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())["stall_timeout"]


def test_train_reads_the_stall_timeout_from_the_environment_when_no_flag_says(mpirun, tmp_path):
    assert _stall_timeout_in_json(mpirun, tmp_path, {"ALLREDUCE_KIT_STALL_TIMEOUT": "7"}) == 7.0


def test_the_flag_wins_over_the_environment(mpirun, tmp_path):
    assert _stall_timeout_in_json(mpirun, tmp_path, {"ALLREDUCE_KIT_STALL_TIMEOUT": "7"},
                                  ["--stall-timeout", "3"]) == 3.0


def test_without_either_the_default_is_60(mpirun, tmp_path):
    assert _stall_timeout_in_json(mpirun, tmp_path, {"ALLREDUCE_KIT_STALL_TIMEOUT": ""}) == 60.0


@pytest.mark.parametrize("cli", [TRAIN, ["-m", "allreduce_kit.bench", "-b", "8", "-e", "8", "-a", "ring"]])
@pytest.mark.parametrize("variable,value", [("ALLREDUCE_KIT_STALL_TIMEOUT", "soon"), ("ALLREDUCE_KIT_CHECK", "maybe"),
                                            ("ALLREDUCE_KIT_DIRECT", "2")])
def test_a_bad_setting_is_one_message_and_status_2(mpirun, cli, variable, value):
    result = mpirun(2, cli, timeout=120, env={variable: value})
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count(f"{variable}={value!r}") == 1
    assert "Traceback" not in result.stderr
