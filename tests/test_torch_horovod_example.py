"""Horovod's own PyTorch example (``examples/horovod_pytorch_mnist.py``), changed only in its import
line and its data loading, trains on 4 ranks to the accuracy it reaches in one process."""
import re

import pytest

from conftest import TESTS

pytest.importorskip("torch")

EXAMPLES = TESTS.parent / "examples"


def final_accuracy(output: str) -> float:
    found = re.findall(r"Accuracy: ([0-9.]+)%", output)
    assert found, output[-3000:]
    return float(found[-1])


@pytest.mark.slow
def test_horovods_mnist_example_trains_to_its_one_process_accuracy(mpirun, tmp_path):
    pytest.importorskip("distutils", reason="Horovod's example imports distutils (Python < 3.12, or setuptools)")
    script = EXAMPLES / "horovod_pytorch_mnist.py"
    common = ["--epochs", "5", "--log-interval", "1000"]
    env = {"HOME": str(tmp_path)}          # the script takes a file lock in the home directory
    alone = mpirun(1, [script, *common, "--lr", "0.1"], timeout=600, env=env)
    assert alone.returncode == 0, alone.stderr[-3000:]
    # 4 ranks with a quarter of the batch and of the learning rate (the script multiplies it by
    # the rank count): the same global batch and step size as one process.
    four = mpirun(4, [script, *common, "--lr", "0.025", "--batch-size", "16"], timeout=600, env=env)
    assert four.returncode == 0, four.stderr[-3000:]
    one_process, four_ranks = final_accuracy(alone.stdout), final_accuracy(four.stdout)
    assert one_process >= 80.0, alone.stdout[-3000:]
    assert four_ranks >= one_process - 5.0, (one_process, four_ranks, four.stdout[-3000:])
