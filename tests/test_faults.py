"""``allreduce_kit.faults`` without a job: which errors mean a dead peer, which launches can recover in the job."""
import pytest
from mpi4py import MPI

from allreduce_kit import faults
from allreduce_kit.run import ulfm_launched


@pytest.mark.parametrize("name, dead", [("ERR_PROC_FAILED", True), ("ERR_PROC_FAILED_PENDING", True),
                                        ("ERR_REVOKED", True), ("ERR_TRUNCATE", False), ("ERR_OTHER", False)])
def test_only_a_peer_failure_counts_as_one(name, dead):
    assert faults.peer_failed(MPI.Exception(getattr(MPI, name))) is dead


def test_other_exceptions_are_not_peer_failures():
    assert not faults.peer_failed(RuntimeError("MPI_ERR_PROC_FAILED"))


@pytest.mark.parametrize("env, expected", [
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_mpi_ft_enable": "1"}, True),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_MCA_mpi_ft_enable": "true"}, True),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_mpi_ft_enable": "0"}, False),
    ({"OMPI_COMM_WORLD_RANK": "0"}, False),                       # Open MPI without --with-ft ulfm
    ({"OMPI_MCA_mpi_ft_enable": "1"}, False),                     # not a rank: the supervisor's process
    ({"PMI_RANK": "0", "MPIR_CVAR_ENABLE_FT": "1"}, False),       # MPICH
])
def test_recovery_in_the_job_is_for_ranks_of_mpirun_with_ft(env, expected):
    assert ulfm_launched(env) is expected


def test_keep_to_messages_is_read_by_each_new_library_communicator():
    from allreduce_kit.comm import library_comm

    try:
        faults.keep_to_messages()
        comm = MPI.COMM_SELF.Dup()
        assert library_comm(comm).messages_only
        faults.keep_to_messages(False)
        other = MPI.COMM_SELF.Dup()
        assert not library_comm(other).messages_only and library_comm(comm).messages_only
    finally:
        faults.keep_to_messages(False)
    for c in (comm, other):
        c.Free()


def test_lost_ranks_of_a_communicator_and_itself_is_none():
    comm = MPI.COMM_SELF.Dup()
    try:
        assert faults.lost_ranks(comm, comm) == []
        assert faults.translate(comm, [0], MPI.COMM_WORLD) == [MPI.COMM_WORLD.Get_rank()]
    finally:
        comm.Free()


@pytest.mark.parametrize("name, nbytes, messages, expected", [
    ("shared_memory", 1000, True, "recursive_doubling"),          # no window in the job: messages, by size
    ("shared_memory", 1 << 20, True, "rabenseifner"),
    ("shared_memory", 1000, False, "shared_memory"),
    ("ring", 1 << 20, True, "ring"),                              # the same schedule, sent as messages
])
def test_what_runs_while_the_library_keeps_to_messages(monkeypatch, name, nbytes, messages, expected):
    monkeypatch.setattr(faults, "messages_only", messages)
    assert faults.runs_as(name, nbytes) == expected


def test_an_epoch_line_carries_its_note():
    from allreduce_kit.train.report import epoch_line

    e = {"epoch": 3, "loss": 0.5, "train_accuracy": 0.9, "test_accuracy": 0.8, "samples_per_second": 1e4, "step_ms": 1.0}
    assert epoch_line(e, 10).endswith("ms")
    assert epoch_line(dict(e, note="redone on 3 ranks, in place of the line above"), 10).endswith(
        "ms  (redone on 3 ranks, in place of the line above)")
