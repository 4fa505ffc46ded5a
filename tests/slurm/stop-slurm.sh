#!/bin/bash
# Stop the daemons that tests/slurm/start-slurm.sh started, by the PIDs it recorded:
# every slurmd, then slurmctld, then munged if start-slurm.sh started it (a munged that was
# already running is left alone). Safe to run twice; leaves the logs in place. A slurmd that runs
# inside a node of the emulated cluster (start-slurm.sh --on-cluster) recorded its PID as that
# node sees it; it is found on the host by that PID within the node's PID namespace.
set -uo pipefail

DIR=${ALLREDUCE_KIT_SLURM_DIR:-/tmp/allreduce_kit-slurm}

say() { echo "stop-slurm: $*"; }

# alive PID: the process exists and is not a zombie (a node's first process of the emulated
# cluster does not reap the daemons that end in it).
alive() {
    [[ -r /proc/$1/status ]] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null
}

# stop PIDFILE NAME: SIGTERM, wait up to 15 s, then SIGKILL. Only a live process whose command
# name matches NAME is signalled, so a stale file never kills an unrelated process.
stop() {
    local pidfile=$1 name=$2 pid comm
    [[ -s $pidfile ]] || return 0
    pid=$(<"$pidfile")
    comm=$(cat "/proc/$pid/comm" 2>/dev/null || true)
    if [[ $pid =~ ^[0-9]+$ && $comm == "$name"* ]]; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 150); do
            alive "$pid" || break
            sleep 0.1
        done
        if alive "$pid"; then
            say "$name (pid $pid) ignored SIGTERM for 15 s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null
        fi
        say "stopped $name (pid $pid)"
    fi
    rm -f "$pidfile"
}

# host_pidfile PIDFILE CLUSTER NODE: a file holding the host's PID of the process whose PID in
# node NODE's PID namespace is in PIDFILE (empty if the node or the process is gone).
host_pidfile() {
    local pidfile=$1 cluster=$2 node=$3 inner holder ns entry out
    out=$(mktemp)
    inner=$(cat "$pidfile" 2>/dev/null || true)
    holder=$(cat "$cluster/$node.pid" 2>/dev/null || true)
    ns=$(readlink "/proc/$holder/ns/pid" 2>/dev/null || true)
    if [[ $inner =~ ^[0-9]+$ && -n $ns ]]; then
        for entry in /proc/[0-9]*; do
            [[ $(readlink "$entry/ns/pid" 2>/dev/null) == "$ns" ]] || continue
            # NSpid: the PID in each nested namespace, the node's last
            if [[ $(awk '/^NSpid:/ {print $NF}' "$entry/status" 2>/dev/null) == "$inner" ]]; then
                echo "${entry#/proc/}" >"$out"
                break
            fi
        done
    fi
    echo "$out"
}

if [[ -s $DIR/slurm.conf ]] && command -v scancel >/dev/null; then
    # Jobs still running would leave slurmstepd processes behind.
    SLURM_CONF=$DIR/slurm.conf timeout 10 scancel --full --quiet --user=root 2>/dev/null || true
fi
for pidfile in "$DIR"/slurmd-*.pid; do
    [[ -e $pidfile ]] || continue
    node=${pidfile##*/slurmd-}
    node=${node%.pid}
    if [[ -s $DIR/slurmd-$node.cluster ]]; then
        found=$(host_pidfile "$pidfile" "$(<"$DIR/slurmd-$node.cluster")" "$node")
        stop "$found" slurmd
        rm -f "$found" "$pidfile" "$DIR/slurmd-$node.cluster"
    else
        stop "$pidfile" slurmd
    fi
done
stop "$DIR/slurmctld.pid" slurmctld
stop "$DIR/munged.pid" munged
exit 0
