#!/usr/bin/env bash
# A real Slurm on this one host, for the tests and benchmarks: munged, slurmctld and four slurmds
# (fake nodes n1..n4, each NodeAddr=127.0.0.1 with its own port), all under DIR, stopped by
# the pids they wrote. Needs root and Debian's packages (slurmctld slurmd slurm-client munge;
# `install` gets them). Clients find the cluster with SLURM_CONF=DIR/slurm.conf.
#
#   bash ci/slurm.sh install        # apt-get the packages (about 12 s)
#   bash ci/slurm.sh up DIR [NODES] # start; prints SLURM_CONF=DIR/slurm.conf when the nodes are idle
#   bash ci/slurm.sh down DIR       # stop every daemon `up` started, by pid; nothing left running
#   bash ci/slurm.sh --help         # this text, and nothing else
case "${1:-}" in  # -h/--help: the usage above, and nothing else
    -h | --help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 0 ;;
esac
set -euo pipefail

install() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null && return 0
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
}

up() {
    local dir nodes host
    dir="$(mkdir -p "$1" && cd "$1" && pwd)"
    nodes="${2:-4}"
    host="$(hostname)"
    for tool in munged slurmctld slurmd sinfo; do
        command -v "$tool" >/dev/null || PATH="$PATH:/usr/sbin"
        command -v "$tool" >/dev/null || { echo "slurm.sh: $tool not installed (bash ci/slurm.sh install)" >&2; exit 3; }
    done
    [ "$(id -u)" = 0 ] || { echo "slurm.sh: slurmd runs as root here; not root" >&2; exit 3; }
    mkdir -p "$dir/ctld" "$dir/log" "$dir/run"
    for n in $(seq 1 "$nodes"); do mkdir -p "$dir/spool/n$n"; done
    # munge: its own key and socket, so that a munged already running here is not touched; in a
    # folder of its own that the munge user can reach (DIR may lie in a root-only tmp folder)
    local munge
    munge="$(mktemp -d /tmp/parity-munge.XXXXXX)"
    echo "$munge" > "$dir/munge.dir"
    dd if=/dev/urandom of="$munge/munge.key" bs=1024 count=1 status=none
    chown -R munge:munge "$munge"
    chmod 700 "$munge"; chmod 400 "$munge/munge.key"
    runuser -u munge -- munged --key-file="$munge/munge.key" --socket="$munge/munge.socket" \
        --pid-file="$munge/munged.pid" --log-file="$munge/munged.log" \
        --seed-file="$munge/munged.seed" --force
    local port_base=$(( 17000 + ($$ % 200) * 10 ))
    {
        echo "ClusterName=parity"
        echo "SlurmctldHost=$host"
        echo "SlurmctldPort=$((port_base))"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "AuthInfo=socket=$munge/munge.socket"
        echo "CredType=cred/munge"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        echo "SchedulerType=sched/backfill"
        echo "MpiDefault=none"
        echo "ReturnToService=2"
        echo "KillWait=2"
        echo "MinJobAge=300"
        echo "StateSaveLocation=$dir/ctld"
        echo "SlurmdSpoolDir=$dir/spool/%n"
        echo "SlurmctldPidFile=$dir/run/slurmctld.pid"
        echo "SlurmdPidFile=$dir/run/slurmd-%n.pid"
        echo "SlurmctldLogFile=$dir/log/slurmctld.log"
        echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
        for n in $(seq 1 "$nodes"); do
            echo "NodeName=n$n NodeHostname=$host NodeAddr=127.0.0.1 Port=$((port_base + n)) CPUs=1 RealMemory=1000 State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP"
    } > "$dir/slurm.conf"
    export SLURM_CONF="$dir/slurm.conf"
    slurmctld -c -f "$SLURM_CONF"
    for n in $(seq 1 "$nodes"); do slurmd -f "$SLURM_CONF" -N "n$n"; done
    local i
    for i in $(seq 1 100); do  # up to 20 s for every node to be idle
        if [ "$(sinfo -h -t idle -o '%D' 2>/dev/null | head -n1)" = "$nodes" ]; then
            echo "SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        sleep 0.2
    done
    echo "slurm.sh: the nodes did not come up (see $dir/log)" >&2
    sinfo >&2 || true
    down "$dir"
    exit 3
}

down() {
    local dir="$1" munge="" pidfile pid pids=() i
    [ -s "$dir/munge.dir" ] && munge="$(cat "$dir/munge.dir")"
    for pidfile in "$dir"/run/slurmd-*.pid "$dir/run/slurmctld.pid" ${munge:+"$munge/munged.pid"}; do
        [ -s "$pidfile" ] || continue
        pid="$(cat "$pidfile")"
        kill "$pid" 2>/dev/null && pids+=("$pid")
    done
    for i in $(seq 1 50); do  # up to 5 s for all of them, then SIGKILL
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    case "$munge" in /tmp/parity-munge.*) rm -rf "$munge" ;; esac
    rm -f "$dir/munge.dir"
}

case "${1:-}" in
    install) install ;;
    up) up "${2:?usage: slurm.sh up DIR [NODES]}" "${3:-4}" ;;
    down) down "${2:?usage: slurm.sh down DIR}" ;;
    *) echo "usage: slurm.sh install | up DIR [NODES] | down DIR | --help" >&2; exit 2 ;;
esac
