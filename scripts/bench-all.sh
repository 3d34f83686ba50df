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
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/target/venv/bin/python
PEER=$(cd "${RANKEXEC_PEER_NVFLARE:-../shared/peers/nvflare}" && pwd)
OUT=$ROOT/target/bench-all
mkdir -p "$OUT"
: > "$OUT/log.txt"
step() { echo "=== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): $*" | tee -a "$OUT/log.txt"; }

step "machine and commit"
{ nproc; free -g | head -2; uname -r; git rev-parse HEAD; git status --short | head; } | tee -a "$OUT/log.txt"

step "build (release binaries, the extension, the divan benches)"
cargo build --release --workspace --bins
VIRTUAL_ENV=$ROOT/target/venv PATH=$ROOT/target/venv/bin:$PATH \
  maturin develop --release -q -m python/Cargo.toml
cargo bench -p rankexec-protocol --no-run
gcc -O2 -o "$OUT/shmem_write" benchmarks/shmem_write.c
gcc -O2 -o "$OUT/map_read" benchmarks/map_read.c

step "rankexec bench (Rust ranks: start-up, round trips, fan-out, events, aborts, crashes, TCP)"
target/release/rankexec bench --json > benchmarks/rankexec-bench.jsonl

step "rankexec bench --peer nvflare (the harness's experiments on rankexec)"
target/release/rankexec bench --peer nvflare > benchmarks/rankexec-peer.jsonl

step "C yardsticks (1 GiB into a memory file; a rank reading it)"
{ "$OUT/shmem_write"; "$OUT/map_read"; } > benchmarks/c-yardsticks.txt 2>&1

step "NVFlare 2.9.0 MultiProcessExecutor (the peer harness)"
NVFBENCH_VENV=$ROOT/target/venv NVFBENCH_RESULTS=$ROOT/benchmarks/nvflare.jsonl \
  bash "$PEER/run.sh" > "$OUT/nvflare.out" 2>&1
"$PY" "$PEER/summarize.py" benchmarks/nvflare.jsonl benchmarks/rankexec-peer.jsonl \
  > benchmarks/side-by-side.md

step "FLARE side by side inside nvflare simulator (Python ranks)"
"$PY" benchmarks/flare/bench.py --peer "$PEER" \
  --only startup,roundtrip,abort,fault_a,fault_b,fault_c --startup-reps 1 --cap 20 \
  > benchmarks/flare/results.jsonl 2> "$OUT/flare-bench.err"
"$PY" "$PEER/summarize.py" benchmarks/flare/results.jsonl > benchmarks/flare/summary.md

step "Python ranks (round trip, start-up beside torchrun, numpy fan-out, parent memory)"
"$PY" benchmarks/python/bench_python_ranks.py --json benchmarks/python/results.json \
  > benchmarks/python/results.txt

step "FLARE Client API scripts side by side (ClientAPIExecutor + torchrun_node vs ScriptExecutor)"
: > benchmarks/flare/results-client-api.jsonl
"$PY" benchmarks/flare/client_api_bench.py --out benchmarks/flare/results-client-api.jsonl \
  > "$OUT/client-api.out" 2>&1

step "FLARE on a POC deployment (ClientAPIExecutor + torchrun_node vs ScriptExecutor, admin API)"
: > benchmarks/flare/results-poc.jsonl
"$PY" benchmarks/flare/poc_bench.py --reps 2 --out benchmarks/flare/results-poc.jsonl \
  > "$OUT/poc.out" 2>&1

step "crash detection and abort latency, idle and saturated (RankGroup, Rust ranks)"
: > benchmarks/crash-abort.jsonl
"$PY" benchmarks/crash_abort.py --trials 7 --json benchmarks/crash-abort.jsonl \
  > "$OUT/crash-abort.out" 2>&1

step "cargo bench -p rankexec-protocol (codec and framing micro-benchmarks)"
cargo bench -p rankexec-protocol > benchmarks/protocol-bench.txt 2>&1

step "done"
