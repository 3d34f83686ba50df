#!/usr/bin/env bash
# Every GPU check of rankexec at once, with figures: run it on a GPU machine.
#
#   scripts/gpu-check.sh            # from anywhere; it runs from the repository root
#   OUT=/some/dir scripts/gpu-check.sh   # also writes $OUT/gpu-check/summary.txt and logs
#
# Needs target/venv (torch with CUDA, nvflare, rankexec installed: `maturin develop`) and
# target/release (cargo build --release); PYTHON=... picks another interpreter. Nothing
# is downloaded. Each check prints PASSED, FAILED (with why) or SKIPPED (with the missing
# prerequisite), then its figures as `FIGURE name value` lines; every check has its own
# timeout, and the whole run stays within GPU_CHECK_BUDGET seconds (420, so under 8
# minutes: a check is cut to what is left, and one that would start with less than 20 s
# left is SKIPPED). Without a GPU every GPU check is SKIPPED; GPU_CHECK_DRY_RUN=1 runs
# their plumbing on the CPU instead (gloo, host memory), to check the script itself.
# GPU_CHECK_H2D_SIZE sets the host-to-device copy's size (4GiB). Exit status: 0 when no
# check failed.
#
# The checks, in order:
#   nvidia-smi      the driver's view (nvidia-smi, and index/uuid/memory per GPU)
#   rankexec-gpus   what rankexec's NVML inventory sees (`rankexec gpus`)
#   placement-*     per_rank with one rank per GPU, shared with one rank more than GPUs:
#                   each rank's CUDA_VISIBLE_DEVICES, LOCAL_RANK, current_device() after
#                   set_device(LOCAL_RANK) and its device UUID against what the host
#                   placed (scripts/gpu_check.py placement)
#   ddp-nccl        NCCL DDP across the local GPUs through a rankexec group (world size 1
#                   on a 1-GPU machine): step time, all-reduce bus bandwidth
#   ddp-shared-*    one rank more than GPUs under gpu.mode shared: NCCL (which refuses two
#                   ranks on one GPU: its error is shown, not counted as a failure) and
#                   gloo over CUDA tensors
#   h2d             a 4 GiB model from a rankexec memory file to the GPU: pageable,
#                   pinned staging, the mapping registered in place (GB/s), and the
#                   same as a state dict of 64 MiB views through
#                   rankexec.tensors.to_device, pin=False against pin=True
#                   (h2d_api_pageable_gbs, h2d_api_pinned_gbs)
#   fsdp-nccl       examples/flare/fsdp under nvflare simulator, FSDP2 on NCCL, one rank
#                   per GPU
#   lightning-gpu   examples/flare/lightning-ddp (accelerator="gpu", devices=2) under the
#                   simulator, when it is there and there are 2 GPUs or more
set -u -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
REPO=$PWD
PY=${PYTHON:-$REPO/target/venv/bin/python}
BUDGET=${GPU_CHECK_BUDGET:-420}
DRY=${GPU_CHECK_DRY_RUN:-0}
H2D_SIZE=${GPU_CHECK_H2D_SIZE:-4GiB}
PYBIN=$(dirname "$PY")
export PATH="$REPO/target/release:$PYBIN:$PATH"
export PYTHONUNBUFFERED=1

# A check run as `gpu-check.sh --one NAME ARGS` (below) shares its parent's folder.
WORK=${GPU_CHECK_WORK:-}
START=$SECONDS
PASSED=0 FAILED=0 SKIPPED=0

say() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }
skip() {
    say "SKIPPED $1: $2"
    SKIPPED=$((SKIPPED + 1))
}

# check NAME LIMIT CMD...: runs CMD under `timeout` (at most LIMIT s and what is left of
# the budget), shows its output (all of it when short, else its FIGURE/RESULT lines and
# its last 40 lines) and counts it (with INFO=1: shows it, counts nothing).
check() {
    local name=$1 limit=$2 left log rc t0
    shift 2
    left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 20 ]; then
        skip "$name" "the budget of ${BUDGET} s is spent"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    log=$WORK/$name.log
    say "== $name (timeout ${limit} s)"
    t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    if [ "$(wc -l <"$log")" -le 60 ]; then
        tee -a "$SUMMARY" <"$log"
    else
        grep -E '^(FIGURE|RESULT) ' "$log" | tee -a "$SUMMARY"
        say "(last 40 of $(wc -l <"$log") lines)"
        grep -vE '^(FIGURE|RESULT) ' "$log" | tail -n 40 | tee -a "$SUMMARY"
    fi
    [ -n "$LOGS" ] && cp "$log" "$LOGS/$name.log"
    if [ "${INFO:-0}" = 1 ]; then
        # Shown for what it says, whatever it returns (NCCL's refusal, for one).
        grep -m3 -E "Duplicate GPU|ncclInvalidUsage" "$log" | tee -a "$SUMMARY"
        say "INFO $name: exit code $rc after $((SECONDS - t0)) s (not counted)"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        say "FAILED $name: timed out after ${limit} s"
        FAILED=$((FAILED + 1))
    elif [ "$rc" -eq 0 ]; then
        say "PASSED $name in $((SECONDS - t0)) s"
        PASSED=$((PASSED + 1))
    else
        say "FAILED $name: exit code $rc after $((SECONDS - t0)) s"
        FAILED=$((FAILED + 1))
    fi
}

# ---- checks that need more than one command (run as `gpu-check.sh --one NAME`) -------

one_nvidia_smi() {
    nvidia-smi || return
    nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,driver_version,pcie.link.gen.current,pcie.link.width.current \
        --format=csv
}

# The script's NCCL choice needs every rank on a GPU of its own: one rank per GPU.
one_fsdp() {
    local ranks=$1 device=$2 ws=$WORK/fsdp-sim n
    local argv=(job.py --clients 1 --ranks "$ranks" --rounds 2 --size 256MiB --workspace "$ws")
    [ "$device" = cpu ] && argv+=(--cpu)
    (cd examples/flare/fsdp && "$PY" "${argv[@]}") || return
    local logs=("$ws"/fsdp/site-1/simulate_job/rankexec/rank-*/stdout.log)
    cat "${logs[@]}"
    if [ "$device" = cuda ] && [ "$(grep -c ": nccl on cuda:" "${logs[@]}" | awk -F: '{s += $NF} END {print s}')" -ne "$ranks" ]; then
        echo "RESULT FAILED not every rank ran on NCCL"
        return 1
    fi
    # rank R: round N: its shards of a M MiB model (shards) in S s, +X MiB allocated
    sed -n 's/^rank \([0-9]*\): round \([0-9]*\): its shards .* in \([0-9.]*\) s, +\([0-9.-]*\) MiB allocated$/FIGURE fsdp_load_s_rank\1_round\2 \3\nFIGURE fsdp_load_allocated_mib_rank\1_round\2 \4/p' "${logs[@]}"
    n=$(cat "${logs[@]}" | grep -c "^rank [0-9]*: done$")
    if [ "$n" -ne "$ranks" ]; then
        echo "RESULT FAILED $n of $ranks ranks ended their loop at END_RUN"
        return 1
    fi
    echo "RESULT ok"
}

one_lightning() {
    local dir=examples/flare/lightning-ddp data=$WORK/cifar out=$WORK/lightning.out result
    "$PY" "$dir/prepare_data.py" --root "$data" || return
    (cd "$dir" && CIFAR10_ROOT=$data "$PY" job.py --n_clients 1 --num_rounds 1) >"$out" 2>&1
    local rc=$?
    cat "$out"
    [ "$rc" -eq 0 ] || return "$rc"
    # Lightning's own line in each rank's log: "GPU available: True (cuda), used: True".
    result=$(sed -n 's/^Result: *//p' "$out" | tail -n 1)
    [ -d "$result" ] || {
        echo "RESULT FAILED no result folder in the job's output"
        return 1
    }
    grep -rh "GPU available" "$result" | sort | uniq -c
    grep -rqh "GPU available: True (cuda), used: True" "$result"
}

if [ "${1:-}" = "--one" ]; then
    shift
    "one_$1" "${@:2}"
    exit
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT
export GPU_CHECK_WORK=$WORK
SUMMARY=$WORK/summary.txt
LOGS=""
if [ -n "${OUT:-}" ]; then
    LOGS=$OUT/gpu-check
    mkdir -p "$LOGS" || exit 2
    SUMMARY=$LOGS/summary.txt
fi
: >"$SUMMARY"

# ---- what is there ---------------------------------------------------------------------

say "gpu-check: $(date -u +%FT%TZ) on $(hostname), $(nproc) CPUs, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
HAVE_PY=0 NGPU=0 HAVE_FLARE=0 HAVE_PL=0
# One interpreter start for every question (torch takes seconds to import).
PROBE='
import importlib.util as u
import torch, rankexec
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(n, int(u.find_spec("nvflare") is not None),
      int(u.find_spec("pytorch_lightning") is not None and u.find_spec("torchvision") is not None),
      torch.__version__, torch.version.cuda)
'
if [ -x "$PY" ] && probe=$(timeout 120 "$PY" -c "$PROBE" 2>/dev/null); then
    read -r NGPU HAVE_FLARE HAVE_PL TORCH CUDA <<<"$probe"
    HAVE_PY=1
    say "python: $PY, torch $TORCH (CUDA $CUDA), CUDA devices: $NGPU"
else
    say "python: $PY cannot import torch and rankexec (a venv: target/venv, with maturin develop)"
fi
HAVE_BIN=0
[ -x target/release/rankexec ] && HAVE_BIN=1
HAVE_SMI=0
command -v nvidia-smi >/dev/null 2>&1 && HAVE_SMI=1

# Where there is no GPU, a dry run checks the plumbing on the CPU.
DEVICE=cuda
RUN_GPU=0
if [ "$NGPU" -gt 0 ]; then
    RUN_GPU=1
elif [ "$DRY" = 1 ] && [ "$HAVE_PY" = 1 ]; then
    RUN_GPU=1 DEVICE=cpu
    say "no GPU: GPU_CHECK_DRY_RUN=1, so the GPU checks run on the CPU (gloo, host memory)"
fi
why_not() {
    if [ "$HAVE_PY" = 0 ]; then
        echo "no Python with torch and rankexec at $PY"
    else
        echo "no CUDA device (torch.cuda.device_count() is 0)"
    fi
}

# ---- the checks --------------------------------------------------------------------------

if [ "$HAVE_SMI" = 1 ]; then
    check nvidia-smi 60 "$0" --one nvidia_smi
else
    skip nvidia-smi "no nvidia-smi on PATH"
fi

if [ "$HAVE_BIN" = 1 ]; then
    check rankexec-gpus 60 target/release/rankexec gpus
else
    skip rankexec-gpus "no target/release/rankexec (cargo build --release)"
fi

GC=(scripts/gpu_check.py)
if [ "$RUN_GPU" = 1 ] && [ "$HAVE_BIN" = 1 ]; then
    n=$((NGPU > 0 ? NGPU : 2))
    if [ "$DEVICE" = cuda ]; then
        check placement-per-rank 120 "$PY" "${GC[@]}" placement --ranks "$n" --mode per_rank
        check placement-shared 120 "$PY" "${GC[@]}" placement --ranks $((n + 1)) --mode shared
    else
        check placement-none 120 "$PY" "${GC[@]}" placement --device cpu --ranks 2 --mode none
    fi
else
    if [ "$HAVE_BIN" = 0 ]; then
        skip placement "no target/release/rankexec (cargo build --release)"
    else
        skip placement "$(why_not)"
    fi
fi

if [ "$RUN_GPU" = 1 ]; then
    if [ "$DEVICE" = cuda ]; then
        check ddp-nccl 150 "$PY" "${GC[@]}" ddp --ranks "$NGPU" --mode per_rank --backend nccl
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); that is shown,
        # not counted: the check that counts is gloo over the same CUDA tensors.
        INFO=1 check ddp-shared-nccl 90 "$PY" "${GC[@]}" ddp --ranks $((NGPU + 1)) --mode shared \
            --backend nccl
        check ddp-shared-gloo 150 "$PY" "${GC[@]}" ddp --ranks $((NGPU + 1)) --mode shared --backend gloo
    else
        check ddp-gloo 150 "$PY" "${GC[@]}" ddp --device cpu --ranks 2 --mode none --backend gloo \
            --width 1024 --allreduce-mib 64
    fi
else
    skip ddp "$(why_not)"
fi

if [ "$RUN_GPU" = 1 ]; then
    # The host's copy until it is staged, the memory file, a pinned copy: 3 sizes.
    need=$("$PY" -c "import sys; sys.path.insert(0, 'scripts'); import gpu_check; print(3 * gpu_check.parse_size('$H2D_SIZE'))")
    avail=$(awk '/^MemAvailable:/ {print $2 * 1024}' /proc/meminfo)
    if [ "$DEVICE" = cpu ]; then
        check h2d 150 "$PY" "${GC[@]}" h2d --device cpu --size 256MiB
    elif [ "$avail" -lt "$need" ]; then
        skip h2d "$H2D_SIZE needs $need bytes of available memory, $avail are"
    else
        check h2d 180 "$PY" "${GC[@]}" h2d --size "$H2D_SIZE"
    fi
else
    skip h2d "$(why_not)"
fi

if [ "$RUN_GPU" = 1 ] && [ "$HAVE_FLARE" = 1 ]; then
    if [ "$DEVICE" = cuda ]; then
        check fsdp-nccl 240 "$0" --one fsdp "$NGPU" cuda
    else
        check fsdp-gloo 240 "$0" --one fsdp 2 cpu
    fi
else
    if [ "$HAVE_PY" = 1 ] && [ "$HAVE_FLARE" = 0 ]; then
        skip fsdp "no nvflare in $PY"
    else
        skip fsdp "$(why_not)"
    fi
fi

if [ ! -f examples/flare/lightning-ddp/job.py ]; then
    skip lightning-gpu "examples/flare/lightning-ddp is not in this tree"
elif [ "$HAVE_PY" = 0 ]; then
    skip lightning-gpu "$(why_not)"
elif [ "$HAVE_FLARE" = 0 ] || [ "$HAVE_PL" = 0 ]; then
    skip lightning-gpu "nvflare, pytorch_lightning or torchvision missing in $PY"
elif [ "$NGPU" -lt 2 ]; then
    skip lightning-gpu "the example trains with devices=2 (one rank per GPU): $NGPU GPU(s) here"
else
    check lightning-gpu 240 "$0" --one lightning
fi

say "gpu-check: $PASSED passed, $FAILED failed, $SKIPPED skipped in $((SECONDS - START)) s"
[ "$FAILED" -eq 0 ]
