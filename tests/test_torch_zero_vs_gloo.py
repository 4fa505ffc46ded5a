"""``allreduce_kit.torch.ZeroRedundancyOptimizer`` trains as PyTorch's
``torch.distributed.optim.ZeroRedundancyOptimizer`` does over Gloo (behind ``DistributedDataParallel``):
the same parameters and the same consolidated optimizer state after K steps, for SGD with
momentum and Adam, stages 1 and 2, at 2 and 3 ranks, on a model of 619 parameters (a count
no rank count here divides). Each rank count is one MPI job (``zero_vs_gloo_driver.py``)."""
import pytest

from conftest import TESTS

pytest.importorskip("torch")


@pytest.mark.parametrize("ranks", [2, 3])
def test_same_parameters_and_state_as_pytorchs_zero_over_gloo(mpirun, ranks):
    result = mpirun(ranks, [TESTS / "zero_vs_gloo_driver.py"], timeout=240)
    assert result.returncode == 0, f"at {ranks} ranks:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    for case in ("SGD stage 1", "SGD stage 2", "Adam stage 1", "Adam stage 2"):
        assert f"{case} at {ranks} ranks: same parameters and state" in result.stdout, result.stdout
