#!/bin/bash
# Stop the daemons that tests/slurm/start-slurm.sh started, by the PIDs it recorded:
# every slurmd, then slurmctld, then munged if start-slurm.sh started it (a munged that was
# already running is left alone). Safe to run twice; leaves the logs in place.
set -uo pipefail

DIR=${ALLREDUCE_KIT_SLURM_DIR:-/tmp/allreduce_kit-slurm}

say() { echo "stop-slurm: $*"; }

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
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            say "$name (pid $pid) ignored SIGTERM for 15 s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null
        fi
        say "stopped $name (pid $pid)"
    fi
    rm -f "$pidfile"
}

if [[ -s $DIR/slurm.conf ]] && command -v scancel >/dev/null; then
    # Jobs still running would leave slurmstepd processes behind.
    SLURM_CONF=$DIR/slurm.conf timeout 10 scancel --full --quiet --user=root 2>/dev/null || true
fi
for pidfile in "$DIR"/slurmd-*.pid; do
    [[ -e $pidfile ]] && stop "$pidfile" slurmd
done
stop "$DIR/slurmctld.pid" slurmctld
stop "$DIR/munged.pid" munged
exit 0
