#!/bin/bash
# Start a real, single-machine Slurm for the test suite: munged, slurmctld and slurmd (or
# several slurmd, one per simulated node), started by hand because CI machines have no systemd.
#
#   sudo tests/slurm/start-slurm.sh          # waits until the nodes are idle, prints the export line
#   sudo tests/slurm/start-slurm.sh --on-cluster   # the same, each slurmd on a node of the emulated cluster
#   export SLURM_CONF=/tmp/allreduce_kit-slurm/slurm.conf
#   sbatch --wait jobs/train.sbatch
#   sudo tests/slurm/stop-slurm.sh
#
# Installs Debian's slurmctld, slurmd, slurm-client and munge (--no-install-recommends) when
# they are missing. Everything it writes lives in $ALLREDUCE_KIT_SLURM_DIR (the configuration,
# state, logs and PID files) except the munge runtime directory and, if the host name does not
# resolve, one line in /etc/hosts. The system's /etc/slurm is left alone: clients find this
# cluster through SLURM_CONF.
#
# With --on-cluster, the nodes are those of the emulated cluster that `python -m
# allreduce_kit.cluster up` made (docs/multinode.md): each slurmd runs inside one node (its own
# network, host name, PIDs, IPC and /dev/shm; NodeAddr is its address on the bridge), and
# slurmctld and munged run on the host, which the nodes reach at the bridge's address (slurmctld)
# and through the shared file system (munge's socket). A job step's ranks on two nodes then talk
# over the nodes' shaped links. The first ALLREDUCE_KIT_SLURM_NODES nodes are used. Without it,
# every slurmd runs on this host, each in a UTS namespace of its own, and ranks of two "nodes"
# share everything but the host name.
#
# Settings (environment):
#   ALLREDUCE_KIT_SLURM_DIR    where everything goes       (default /tmp/allreduce_kit-slurm)
#   ALLREDUCE_KIT_SLURM_CPUS   CPUs declared per node       (default 8, whatever the hardware)
#   ALLREDUCE_KIT_SLURM_NODES  nodes, 1 or more              (default 2, all on this machine)
#   ALLREDUCE_KIT_SLURM_PORT   slurmctld port; slurmd use the next ones (default 6817)
#
# Facts this relies on (Slurm 22.05 from Debian 12): SlurmUser=root; no cgroups
# (proctrack/linuxproc, task/none); no accounting; declaring more CPUs than the machine has needs
# SlurmdParameters=config_overrides; MpiDefault=pmi2 makes a plain srun start MPICH ranks that
# see each other; a small MinJobAge lets `sbatch --wait` return promptly; EnforcePartLimits=ALL
# rejects an impossible request at submission instead of leaving it pending.
set -euo pipefail

DIR=${ALLREDUCE_KIT_SLURM_DIR:-/tmp/allreduce_kit-slurm}
CPUS=${ALLREDUCE_KIT_SLURM_CPUS:-8}
NODES=${ALLREDUCE_KIT_SLURM_NODES:-2}
PORT=${ALLREDUCE_KIT_SLURM_PORT:-6817}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CLUSTER=""   # the emulated cluster's state directory, with --on-cluster
case ${1:-} in
    "") ;;
    --on-cluster) CLUSTER=/run/allreduce_kit-cluster ;;
    *) echo "usage: $0 [--on-cluster]" >&2; exit 2 ;;
esac

say() { echo "start-slurm: $*"; }
die() { echo "start-slurm: error: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (Slurm's daemons run as SlurmUser=root here)"
[[ $CPUS =~ ^[1-9][0-9]*$ ]] || die "ALLREDUCE_KIT_SLURM_CPUS must be a positive integer, not '$CPUS'"
[[ $NODES =~ ^[1-9][0-9]*$ ]] || die "ALLREDUCE_KIT_SLURM_NODES must be a positive integer, not '$NODES'"
if [[ -n $CLUSTER && ! -s $CLUSTER/state.json ]]; then
    die "--on-cluster: no emulated cluster is up: run 'python -m allreduce_kit.cluster up --nodes $NODES' first"
fi

# ---- 1. software ---------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get to install it"
    say "installing slurmctld slurmd slurm-client munge (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi
say "$(slurmctld -V)"

# A previous run's daemons (a crashed test session) would hold the ports: stop them first.
if compgen -G "$DIR/*.pid" >/dev/null; then
    "$HERE/stop-slurm.sh"
fi
rm -rf "$DIR"
mkdir -p "$DIR/state" "$DIR/spool"

# ---- 2. names: the host must resolve, and so must every simulated node ------------------------
HOST=$(hostname -s)
if ! getent hosts "$HOST" >/dev/null; then
    say "host name '$HOST' does not resolve: adding it to /etc/hosts"
    echo "127.0.0.1 $HOST" >>/etc/hosts
fi
NODE_NAMES=()
NODE_ADDRS=()
CTLD_ADDR=127.0.0.1
if [[ -n $CLUSTER ]]; then
    # The cluster's hosts file names the bridge (akc-br) and every node, with their addresses;
    # every node reads it as its /etc/hosts.
    while read -r address name; do
        if [[ $name == akc-br ]]; then
            CTLD_ADDR=$address
        elif [[ $name != localhost && ${#NODE_NAMES[@]} -lt $NODES ]]; then
            NODE_NAMES+=("$name")
            NODE_ADDRS+=("$address")
        fi
    done <"$CLUSTER/hosts"
    [[ ${#NODE_NAMES[@]} -eq $NODES ]] \
        || die "--on-cluster: the cluster has ${#NODE_NAMES[@]} node(s), ALLREDUCE_KIT_SLURM_NODES asks for $NODES"
    [[ $CTLD_ADDR != 127.0.0.1 ]] || die "--on-cluster: no bridge address in $CLUSTER/hosts"
elif [[ $NODES -eq 1 ]]; then
    NODE_NAMES=("$HOST")
    NODE_ADDRS=(127.0.0.1)
else
    # Several slurmd on one machine, each a node of its own: its own name, port and spool, and
    # its own host name (a UTS namespace), so that MPI too sees ranks on different hosts and
    # talks between them over TCP rather than shared memory. The names resolve to 127.0.0.1.
    for ((i = 1; i <= NODES; i++)); do
        NODE_NAMES+=("allreduce-node-$i")
        NODE_ADDRS+=(127.0.0.1)
        if ! getent hosts "allreduce-node-$i" >/dev/null; then
            say "adding allreduce-node-$i to /etc/hosts (127.0.0.1)"
            echo "127.0.0.1 allreduce-node-$i" >>/etc/hosts
        fi
    done
fi

# ---- 3. configuration --------------------------------------------------------------------------
{
    echo "# Written by tests/slurm/start-slurm.sh: a one-machine test cluster, no cgroups."
    echo "ClusterName=allreducekit"
    echo "SlurmctldHost=$HOST($CTLD_ADDR)"
    echo "SlurmctldPort=$PORT"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "StateSaveLocation=$DIR/state"
    # job ids that an earlier cluster did not use: MPICH names its shared-memory segments after the
    # job step, and a segment left by a rank killed in an earlier run must not meet a new step's
    echo "FirstJobId=$(( (RANDOM * 32768 + RANDOM) % 60000000 + 1000 ))"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/slurmd-%n.pid"
    echo "SlurmctldLogFile=$DIR/slurmctld.log"
    echo "SlurmdLogFile=$DIR/slurmd-%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobCompType=jobcomp/none"
    echo "SchedulerType=sched/backfill"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "MpiDefault=pmi2"
    echo "SlurmdParameters=config_overrides"
    echo "MinJobAge=4"
    echo "EnforcePartLimits=ALL"
    echo "ReturnToService=2"
    echo "KillWait=5"
    echo "InactiveLimit=0"
    echo "SlurmdTimeout=60"
    echo "SlurmctldTimeout=60"
    for ((i = 0; i < ${#NODE_NAMES[@]}; i++)); do
        echo "NodeName=${NODE_NAMES[$i]} NodeHostname=${NODE_NAMES[$i]} NodeAddr=${NODE_ADDRS[$i]} Port=$((PORT + 1 + i)) CPUs=$CPUS State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=30 State=UP OverSubscribe=NO"
} >"$DIR/slurm.conf"
for node in "${NODE_NAMES[@]}"; do mkdir -p "$DIR/spool/$node"; done
export SLURM_CONF=$DIR/slurm.conf

# ---- 4. munged ---------------------------------------------------------------------------------
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "munged already running: using it"
else
    [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    chmod 755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    cp /run/munge/munged.pid "$DIR/munged.pid"   # ours: stop-slurm.sh stops it
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
    munge -n | unmunge >/dev/null || die "munged does not answer"
    say "munged started (pid $(cat "$DIR/munged.pid"))"
fi

# ---- 5. slurmctld and slurmd -------------------------------------------------------------------
slurmctld -f "$SLURM_CONF" -c -i || die "slurmctld did not start; see $DIR/slurmctld.log"
for node in "${NODE_NAMES[@]}"; do
    if [[ -n $CLUSTER ]]; then
        # slurmd looks for the cgroup file system even with proctrack/linuxproc, and a node's
        # /sys is its network namespace's own sysfs, without it: give the node the host's
        # cgroup v1 "name=systemd" hierarchy (the one slurmd checks for).
        "$CLUSTER/enter" "$node" "mountpoint -q /sys/fs/cgroup/systemd || { mount -t tmpfs -o mode=755 tmpfs \
            /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd && mount -t cgroup -o none,name=systemd cgroup \
            /sys/fs/cgroup/systemd; }" || die "cannot mount the cgroup file system on node $node"
        # inside the node (the cluster's own way in); slurmd's PID file then holds its PID there
        "$CLUSTER/enter" "$node" slurmd -f "$SLURM_CONF" -N "$node"
        echo "$CLUSTER" >"$DIR/slurmd-$node.cluster"
    elif [[ $node == "$HOST" ]]; then
        slurmd -f "$SLURM_CONF" -N "$node"
    else
        # shellcheck disable=SC2016  # $1 and $2 expand in the inner shell, on purpose
        unshare --uts /bin/sh -c 'hostname "$1" && exec slurmd -f "$2" -N "$1"' sh "$node" "$SLURM_CONF"
    fi || die "slurmd $node did not start; see $DIR/slurmd-$node.log"
done

# ---- 6. wait until every node is idle ----------------------------------------------------------
deadline=$((SECONDS + 60))
while :; do
    states=$(sinfo -h -N -o '%N %T' 2>/dev/null || true)
    idle=$(grep -c ' idle$' <<<"$states" || true)
    [[ $idle -eq ${#NODE_NAMES[@]} ]] && break
    if ((SECONDS > deadline)); then
        echo "$states" >&2
        tail -n 20 "$DIR"/slurm*.log >&2 || true
        die "nodes not idle after 60 s"
    fi
    sleep 0.5
done
where=""
[[ -z $CLUSTER ]] || where=" (inside the emulated cluster's nodes, controller at $CTLD_ADDR)"
say "${#NODE_NAMES[@]} node(s) idle, $CPUS CPUs each: ${NODE_NAMES[*]}$where"
echo "export SLURM_CONF=$SLURM_CONF"
