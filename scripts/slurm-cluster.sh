#!/usr/bin/env bash
# A real, single-machine Slurm cluster in a temporary directory, for tests.
#
#   scripts/slurm-cluster.sh start DIR   start munged, slurmctld and slurmd under DIR
#                                        (slurm.conf generated there with this machine's
#                                        CPUs and memory); prints SLURM_CONF=DIR/slurm.conf
#   scripts/slurm-cluster.sh stop DIR    cancel every job, stop the daemons, check that
#                                        none is left
#
# Needs root (slurmd runs job steps as their users) and Debian's packages
# `slurmctld slurmd slurm-client munge`. Exit status 3 with a line naming what is
# missing means "cannot run here" (the caller skips).
set -euo pipefail

say() { printf '==> slurm-cluster: %s\n' "$*" >&2; }
skip() { printf 'SKIPPED: %s\n' "$*" >&2; exit 3; }

cmd="${1:-}"
DIR="${2:-}"
[ -n "$cmd" ] && [ -n "$DIR" ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }

pid_of() { cat "$DIR/$1.pid" 2>/dev/null || true; }

stop() {
    export SLURM_CONF="$DIR/slurm.conf"
    if [ -f "$SLURM_CONF" ] && command -v scancel >/dev/null; then
        scancel --quiet --full "--user=$(id -un)" 2>/dev/null || true
    fi
    for d in slurmd slurmctld munged; do
        local pid
        pid="$(pid_of "$d")"
        [ -n "$pid" ] || continue
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            say "$d ($pid) ignored SIGTERM for 10 s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$DIR/$d.pid"
    done
}

case "$cmd" in
stop)
    stop
    exit 0
    ;;
start) ;;
*)
    echo "usage: $0 start|stop DIR" >&2
    exit 2
    ;;
esac

[ "$(id -u)" -eq 0 ] || skip "Slurm's slurmd must run as root (running as uid $(id -u))"
for b in slurmctld slurmd slurmstepd munged srun squeue scancel; do
    command -v "$b" >/dev/null || PATH="$PATH:/usr/sbin"
    command -v "$b" >/dev/null || skip "$b is not installed (apt-get install slurmctld slurmd slurm-client munge)"
done

mkdir -p "$DIR"/{state,spool,munge}
chmod 0700 "$DIR/munge"
HOST="$(hostname -s)"
CPUS="$(nproc --all)"
MEM_MB="$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)"
# A free port below the kernel's ephemeral range, where an outgoing connection cannot
# take it before the daemon binds it (python/rankexec/_ports.py says why).
free_port() {
    python3 -c '
import random, socket
high = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(64):
    port = random.randrange(25000, max(high, 25065))
    try:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))
        print(port)
        break
    except OSError:
        pass
else:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        print(s.getsockname()[1])
'
}
CTLD_PORT="$(free_port)"
SLURMD_PORT="$(free_port)"
while [ "$SLURMD_PORT" = "$CTLD_PORT" ]; do SLURMD_PORT="$(free_port)"; done

# munge: its own key and socket under DIR, so a system munged is left alone.
dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 0400 "$DIR/munge/munge.key"
munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munge/seed" \
    || { cat "$DIR/munged.log" >&2 || true; skip "munged does not start here"; }

cat >"$DIR/slurm.conf" <<EOF
ClusterName=rankexec-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.log
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=60
SchedulerType=sched/builtin
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
export SLURM_CONF="$DIR/slurm.conf"

started=0
trap '[ "$started" = 1 ] || stop' EXIT
slurmctld -f "$SLURM_CONF" -i || { cat "$DIR/slurmctld.log" >&2 || true; skip "slurmctld does not start here"; }
slurmd -f "$SLURM_CONF" || { cat "$DIR/slurmd.log" >&2 || true; skip "slurmd does not start here"; }

# Up when the node is idle (bounded wait).
for _ in $(seq 1 300); do
    state="$(sinfo -h -N -o '%T' 2>/dev/null | head -1 || true)"
    case "$state" in
    idle*) break ;;
    esac
    sleep 0.1
done
case "${state:-}" in
idle*) ;;
*)
    tail -20 "$DIR/slurmctld.log" "$DIR/slurmd.log" >&2 || true
    skip "the Slurm node never became idle (state: ${state:-none})"
    ;;
esac
started=1
say "up: node $HOST, $CPUS CPUs, $MEM_MB MB, slurmctld :$CTLD_PORT, slurmd :$SLURMD_PORT"
echo "SLURM_CONF=$SLURM_CONF"
