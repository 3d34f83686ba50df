#!/usr/bin/env bash
# srun under a real Slurm: starts a single-machine Slurm cluster from Debian's packages
# in a temporary directory (scripts/slurm-cluster.sh), runs tests/slurm.rs against it,
# then the cluster recipe of examples/slurm as its page shows it (sbatch
# train.sbatch executor.json on one node with 2 ranks: srun, the TCP transport; about
# 10 s), and stops it again, even when a test fails.
#
#   scripts/slurm-test.sh [CARGO ARGS...]   e.g. --features mpi, to reuse a build
#
# Installs `slurmctld slurmd slurm-client munge` with apt-get when they are missing and
# it may (root, RANKEXEC_NO_INSTALL unset). Where Slurm cannot run (not root, no
# packages, a daemon that does not start) it prints `SKIPPED: <reason>` and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '==> %s\n' "$*" >&2; }
PACKAGES="slurmctld slurmd slurm-client munge"
PATH="$PATH:/usr/sbin"

if [ "$(id -u)" -ne 0 ]; then
    echo "SKIPPED: srun under Slurm: slurmd must run as root (running as uid $(id -u))" >&2
    exit 0
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v srun >/dev/null || ! command -v munged >/dev/null; then
    if command -v apt-get >/dev/null && [ "${RANKEXEC_NO_INSTALL:-0}" != 1 ]; then
        say "installing Slurm: apt-get install $PACKAGES"
        env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            $PACKAGES >/dev/null 2>&1 \
            || { env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
                && env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                    --no-install-recommends $PACKAGES >/dev/null; } \
            || true
    fi
    if ! command -v slurmctld >/dev/null || ! command -v srun >/dev/null \
        || ! command -v munged >/dev/null; then
        echo "SKIPPED: srun under Slurm: Slurm is not installed and cannot be" \
            "(apt-get install $PACKAGES)" >&2
        exit 0
    fi
fi

DIR="$(mktemp -d "${TMPDIR:-/tmp}/rankexec-slurm.XXXXXX")"
cleanup() {
    scripts/slurm-cluster.sh stop "$DIR" || true
    rm -rf "$DIR"
}
trap cleanup EXIT

rc=0
scripts/slurm-cluster.sh start "$DIR" >/dev/null || rc=$?
if [ "$rc" -eq 3 ]; then
    exit 0 # slurm-cluster.sh printed SKIPPED and why
elif [ "$rc" -ne 0 ]; then
    exit "$rc"
fi

say "cargo test --test slurm $* (srun under the cluster at $DIR)"
RANKEXEC_TEST_SLURM_CONF="$DIR/slurm.conf" cargo test "$@" --test slurm -- --test-threads=1

# The recipe of docs/gpus-launchers.md ("srun inside an sbatch allocation"), one node.
say "examples/slurm: sbatch --wait train.sbatch executor.json (1 node, 2 ranks)"
cargo build --release --locked -q --bin rankexec
OUT="$DIR/recipe.out"
if ! SLURM_CONF="$DIR/slurm.conf" PATH="$PWD/target/release:$PATH" timeout 600 \
    sbatch --wait --quiet --nodes=1 --ntasks-per-node=2 --output="$OUT" \
    examples/slurm/train.sbatch examples/slurm/executor.json 2; then
    echo "error: the examples/slurm recipe failed:" >&2
    cat "$OUT" >&2 || true
    exit 1
fi
for want in "rankexec host on .*: 2 ranks on 1 node" "round 0: ok" "round 1: ok" "group stopped"; do
    grep -q "$want" "$OUT" || { echo "error: no \"$want\" in the recipe's output:" >&2; cat "$OUT" >&2; exit 1; }
done

scripts/slurm-cluster.sh stop "$DIR"
for d in slurmctld slurmd slurmstepd; do
    if pgrep -x "$d" >/dev/null; then
        echo "error: $d still runs after the cluster was stopped: $(pgrep -x "$d" | tr '\n' ' ')" >&2
        exit 1
    fi
done
say "srun under Slurm: passed; the cluster is stopped"
