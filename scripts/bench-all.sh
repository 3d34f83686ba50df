#!/usr/bin/env bash
# Every benchmark behind BENCHMARKS.md, one after the other, in one run on one machine
# (about an hour on 2 vCPUs). Run it on an otherwise idle machine.
#
# Needs: scripts/test.sh run once (target/venv with nvflare 2.9.0, torch and this
# package; release binaries), gcc, and the NVFlare peer harness (default
# ../shared/peers/nvflare, or RANKEXEC_PEER_NVFLARE).
#
# Writes the raw records into benchmarks/ (the files BENCHMARKS.md names) and a log of
# every step, with its start time and the machine's load, to target/bench-all/log.txt.
#
# RANKEXEC_DRY_RUN=1: check that every file of the repository a step runs is there
# (exit 2 naming the first that is not), say which of the needs above this machine has
# (`needs: ...: found` or `missing`), print one `dry run: STEP` line per step, in order,
# and exit 0 without running, building or writing anything (python/tests/test_docs.py
# runs docs/benchmarks.md's commands so).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/target/venv/bin/python
PEER_DIR=${RANKEXEC_PEER_NVFLARE:-../shared/peers/nvflare}
OUT=$ROOT/target/bench-all
DRY=${RANKEXEC_DRY_RUN:-0}

if [ "$DRY" = 1 ]; then
    # The repository's files the steps below run (keep in step with them).
    for f in benchmarks/shmem_write.c benchmarks/map_read.c python/Cargo.toml \
        benchmarks/flare/bench.py benchmarks/python/bench_python_ranks.py \
        benchmarks/flare/client_api_bench.py benchmarks/flare/poc_bench.py \
        benchmarks/crash_abort.py; do
        [ -f "$f" ] || { echo "bench-all: error: $f is missing" >&2; exit 2; }
    done
    need() { if [ -e "$2" ]; then echo "needs: $1 ($2): found"; else echo "needs: $1 ($2): missing"; fi; }
    need "the venv scripts/test.sh makes" "$PY"
    need "the NVFlare peer harness" "$PEER_DIR/run.sh"
    need gcc "$(command -v gcc || echo gcc)"
    step() { echo "dry run: $*"; }
    # Each step below runs only when not a dry run.
    run() { :; }
else
    PEER=$(cd "$PEER_DIR" && pwd)
    mkdir -p "$OUT"
    : > "$OUT/log.txt"
    step() { echo "=== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): $*" | tee -a "$OUT/log.txt"; }
    run() { "$@"; }
fi

machine() {
    { nproc; free -g | head -2; uname -r; git rev-parse HEAD; git status --short | head; } | tee -a "$OUT/log.txt"
}
step "machine and commit"
run machine

build() {
    cargo build --release --workspace --bins
    VIRTUAL_ENV=$ROOT/target/venv PATH=$ROOT/target/venv/bin:$PATH \
      maturin develop --release -q -m python/Cargo.toml
    cargo bench -p rankexec-protocol --no-run
    gcc -O2 -o "$OUT/shmem_write" benchmarks/shmem_write.c
    gcc -O2 -o "$OUT/map_read" benchmarks/map_read.c
}
step "build (release binaries, the extension, the divan benches)"
run build

rankexec_bench() { target/release/rankexec bench --json > benchmarks/rankexec-bench.jsonl; }
step "rankexec bench (Rust ranks: start-up, round trips, fan-out, events, aborts, crashes, TCP)"
run rankexec_bench

peer_bench() { target/release/rankexec bench --peer nvflare > benchmarks/rankexec-peer.jsonl; }
step "rankexec bench --peer nvflare (the harness's experiments on rankexec)"
run peer_bench

yardsticks() { { "$OUT/shmem_write"; "$OUT/map_read"; } > benchmarks/c-yardsticks.txt 2>&1; }
step "C yardsticks (1 GiB into a memory file; a rank reading it)"
run yardsticks

nvflare_peer() {
    NVFBENCH_VENV=$ROOT/target/venv NVFBENCH_RESULTS=$ROOT/benchmarks/nvflare.jsonl \
      bash "$PEER/run.sh" > "$OUT/nvflare.out" 2>&1
    "$PY" "$PEER/summarize.py" benchmarks/nvflare.jsonl benchmarks/rankexec-peer.jsonl \
      > benchmarks/side-by-side.md
}
step "NVFlare 2.9.0 MultiProcessExecutor (the peer harness)"
run nvflare_peer

flare_side_by_side() {
    "$PY" benchmarks/flare/bench.py --peer "$PEER" \
      --only startup,roundtrip,abort,fault_a,fault_b,fault_c --startup-reps 1 --cap 20 \
      > benchmarks/flare/results.jsonl 2> "$OUT/flare-bench.err"
    "$PY" "$PEER/summarize.py" benchmarks/flare/results.jsonl > benchmarks/flare/summary.md
}
step "FLARE side by side inside nvflare simulator (Python ranks)"
run flare_side_by_side

python_ranks() {
    "$PY" benchmarks/python/bench_python_ranks.py --json benchmarks/python/results.json \
      > benchmarks/python/results.txt
}
step "Python ranks (round trip, start-up beside torchrun, numpy fan-out, parent memory)"
run python_ranks

client_api() {
    : > benchmarks/flare/results-client-api.jsonl
    "$PY" benchmarks/flare/client_api_bench.py --out benchmarks/flare/results-client-api.jsonl \
      > "$OUT/client-api.out" 2>&1
}
step "FLARE Client API scripts side by side (ClientAPIExecutor + torchrun_node vs ScriptExecutor)"
run client_api

poc() {
    : > benchmarks/flare/results-poc.jsonl
    "$PY" benchmarks/flare/poc_bench.py --reps 2 --out benchmarks/flare/results-poc.jsonl \
      > "$OUT/poc.out" 2>&1
}
step "FLARE on a POC deployment (ClientAPIExecutor + torchrun_node vs ScriptExecutor, admin API)"
run poc

crash_abort() {
    : > benchmarks/crash-abort.jsonl
    "$PY" benchmarks/crash_abort.py --trials 7 --json benchmarks/crash-abort.jsonl \
      > "$OUT/crash-abort.out" 2>&1
}
step "crash detection and abort latency, idle and saturated (RankGroup, Rust ranks)"
run crash_abort

protocol_bench() { cargo bench -p rankexec-protocol > benchmarks/protocol-bench.txt 2>&1; }
step "cargo bench -p rankexec-protocol (codec and framing micro-benchmarks)"
run protocol_bench

[ "$DRY" = 1 ] || step "done"
