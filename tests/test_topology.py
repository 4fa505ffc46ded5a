"""Where ranks sit, from what each rank reports: nodes, local ranks, cores, oversubscription,
and the thread share that follows. Slurm-like environments are given as plain dictionaries."""
import pytest

from allreduce_kit import config
from allreduce_kit.topology import (Topology, cores_from_environment, local_size_from_launcher, node_cores,
                                    oversubscribed_from_launcher, spans_nodes_from_launcher, user_threads)

NO_THREADS_SET = {}


def test_eight_tasks_of_one_cpu_on_an_eight_core_node_are_not_oversubscribed():
    # srun -n 8 --cpus-per-task 1: each task bound to its own core, Slurm allocated 8 on the node
    env = {"SLURM_CPUS_PER_TASK": "1", "SLURM_CPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "8"}
    cores = node_cores([(c,) for c in range(8)], env)
    layout = Topology.from_parts(3, [0] * 8, [cores])
    assert cores == 8
    assert not layout.oversubscribed
    assert layout.threads(NO_THREADS_SET) == 1
    # and before MPI starts, from the environment alone, even though this task sees one core
    assert not oversubscribed_from_launcher(env)


def test_eight_ranks_on_a_two_core_laptop_are_oversubscribed():
    layout = Topology.from_parts(5, [0] * 8, [node_cores([(0, 1)] * 8, {})])
    assert layout.cores_per_node == (2,)
    assert layout.oversubscribed
    assert layout.threads(NO_THREADS_SET) == 1


def test_slurm_allocation_caps_the_cores_ranks_could_run_on():
    # tasks not bound: every rank sees all 64 cores, but the job has 16 of them on this node
    assert node_cores([tuple(range(64))] * 4, {"SLURM_CPUS_ON_NODE": "16"}) == 16
    assert node_cores([tuple(range(64))] * 4, {}) == 64


@pytest.mark.parametrize("ranks,cores,expected", [(1, 8, 8), (3, 8, 2), (8, 8, 1), (16, 8, 1), (2, 2, 1)])
def test_thread_share_is_cores_over_ranks_on_the_node_at_least_one(ranks, cores, expected):
    layout = Topology.from_parts(0, [0] * ranks, [cores])
    assert layout.threads(NO_THREADS_SET) == expected


def test_the_users_thread_setting_wins():
    layout = Topology.from_parts(0, [0] * 8, [2])
    assert layout.threads({"NUMBA_NUM_THREADS": "3"}) == 3
    assert layout.threads({"OMP_NUM_THREADS": "5"}) == 5
    assert user_threads({"NUMBA_NUM_THREADS": "0", "OMP_NUM_THREADS": "2"}) == 2


def test_two_nodes_round_robin():
    # ranks 0, 2, 4 on node 0 (4 cores), ranks 1, 3 on node 1 (2 cores)
    layout = Topology.from_parts(3, [0, 1, 0, 1, 0], [4, 2], ["a", "b"])
    assert (layout.nodes, layout.node, layout.node_ranks, layout.local_rank, layout.local_size) == (2, 1, (1, 3), 1, 2)
    assert layout.ranks_per_node == (3, 2) and not layout.single_node
    assert not layout.oversubscribed
    assert layout.threads(NO_THREADS_SET) == 1
    assert Topology.from_parts(0, [0, 1, 0, 1, 0], [2, 2]).oversubscribed  # 3 ranks on node 0's 2 cores


def test_nodes_on_one_machine_share_its_cores():
    # two containers (nodes) of 4 ranks on one 2-core host: each node sees the host's 2 cores
    shared = Topology.from_parts(1, [0, 1] * 4, [2, 2], ["n1", "n2"], machine_of=[0, 0], cores_per_machine=[2])
    assert shared.ranks_per_machine == (8,)
    assert shared.oversubscribed
    assert shared.threads(NO_THREADS_SET) == 1
    # two nodes of 1 rank on one 4-core host: each node alone would give its rank 4 threads
    assert Topology.from_parts(0, [0, 1], [4, 4], machine_of=[0, 0], cores_per_machine=[4]).threads(NO_THREADS_SET) == 2
    # the same layout on two hosts of their own
    apart = Topology.from_parts(1, [0, 1] * 4, [4, 4], ["a", "b"], machine_of=[0, 1], cores_per_machine=[4, 4])
    assert not apart.oversubscribed and apart.threads(NO_THREADS_SET) == 1
    assert not Topology.from_parts(1, [0, 1] * 4, [4, 4]).oversubscribed  # machines unknown: a node is one


def test_a_few_ranks_of_a_busy_machine_share_it_with_the_rest_of_the_job():
    # a communicator of 2 ranks on a 2-core machine where the job has 8 ranks
    few = Topology.from_parts(0, [0, 0], [2], machine_of=[0], cores_per_machine=[2], ranks_per_machine=[8])
    assert few.oversubscribed and few.ranks_per_machine == (8,)
    alone = Topology.from_parts(0, [0, 0], [2], machine_of=[0], cores_per_machine=[2])
    assert not alone.oversubscribed and alone.ranks_per_machine == (2,)


def test_machines_must_cover_the_nodes():
    with pytest.raises(ValueError, match="machine_of"):
        Topology.from_parts(0, [0, 1], [2, 2], machine_of=[0], cores_per_machine=[2])
    with pytest.raises(ValueError, match="machine_of"):
        Topology.from_parts(0, [0, 1], [2, 2], machine_of=[0, 2], cores_per_machine=[2, 2])
    with pytest.raises(ValueError, match="ranks_per_machine"):
        Topology.from_parts(0, [0, 1], [2, 2], machine_of=[0, 0], cores_per_machine=[2], ranks_per_machine=[2, 2])


def test_nodes_must_be_numbered_from_zero():
    with pytest.raises(ValueError, match="node_of"):
        Topology.from_parts(0, [0, 2], [1, 1])


@pytest.mark.parametrize("env,expected", [
    ({"MPI_LOCALNRANKS": "6"}, 6), ({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 3), ({"SLURM_NTASKS_PER_NODE": "8"}, 8),
    ({"SLURM_TASKS_PER_NODE": "8(x2),4"}, 8), ({"MPI_LOCALNRANKS": "x"}, None), ({}, None),
])
def test_local_size_from_the_launchers_environment(env, expected):
    assert local_size_from_launcher(env) == expected


@pytest.mark.parametrize("env,expected", [
    ({"MPI_LOCALNRANKS": "4", "PMI_SIZE": "8"}, True), ({"MPI_LOCALNRANKS": "4", "PMI_SIZE": "4"}, False),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "6"}, True),
    ({"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NTASKS": "8"}, True), ({"SLURM_NTASKS_PER_NODE": "8", "SLURM_NTASKS": "8"}, False),
    ({"PMI_SIZE": "8"}, False), ({"MPI_LOCALNRANKS": "4"}, False), ({}, False),
])
def test_whether_the_job_spans_nodes_from_the_launchers_environment(env, expected):
    """More ranks in the job than on this node; unknown (a size missing) counts as one node."""
    assert spans_nodes_from_launcher(env) is expected


def test_cores_before_mpi_prefer_slurms_allocation():
    assert cores_from_environment({"SLURM_CPUS_ON_NODE": "12"}) == 12
    assert cores_from_environment({}) >= 1


@pytest.mark.parametrize("setting,raw,value", [
    (config.STALL_TIMEOUT, "7.5", 7.5), (config.STALL_TIMEOUT, "", 60.0), (config.CHECK, "yes", True),
    (config.CHECK, "0", False), (config.DIRECT, "off", False), (config.TUNING, " builtin ", "builtin"),
])
def test_settings_parse(setting, raw, value):
    assert config.read(setting, {setting.name: raw}) == value


@pytest.mark.parametrize("setting,raw", [(config.STALL_TIMEOUT, "soon"), (config.STALL_TIMEOUT, "-1"),
                                         (config.STALL_TIMEOUT, "nan"), (config.STALL_TIMEOUT, "inf"),
                                         (config.CHECK, "maybe"), (config.YIELD, "2")])
def test_a_bad_setting_names_the_variable_and_the_value(setting, raw):
    with pytest.raises(ValueError, match=f"{setting.name}={raw!r}"):
        config.read(setting, {setting.name: raw})


def test_every_setting_is_in_the_docs_table():
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs" / "settings.md"
    if not docs.exists():
        pytest.skip("not run from a source checkout")
    text = docs.read_text()
    for setting in config.SETTINGS:
        assert f"`{setting.name}`" in text, f"{setting.name} is missing from docs/settings.md"
