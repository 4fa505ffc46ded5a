"""``allreduce_kit.torch.pipelining``'s ``ScheduleGPipe`` and ``Schedule1F1B`` train as
``torch.distributed.pipelining``'s do over Gloo on the same split model and micro-batches: the
same first-step gradients, losses, outputs and parameters after three SGD steps (float64, allclose
1e-10), at 2 ranks, in one MPI job (``pipelining_vs_torch_driver.py``)."""
import pytest

from conftest import TESTS

pytest.importorskip("torch")


def test_same_gradients_and_parameters_as_torch_distributed_pipelining_over_gloo(mpirun):
    result = mpirun(2, [TESTS / "pipelining_vs_torch_driver.py"], timeout=240)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    for name in ("ScheduleGPipe", "Schedule1F1B"):
        assert f"{name} at 2 ranks: same gradients and parameters as torch.distributed.pipelining" in result.stdout
