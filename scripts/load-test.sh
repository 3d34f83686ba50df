#!/usr/bin/env bash
# The test suites on a saturated machine: starts busy processes (2 x the cores by
# default), runs a suite beside them, stops them, and reports how long the suite took and
# whether it passed. A site's machine is rarely idle; a test that only passes on an idle
# one waits on time instead of on a condition (issue 27.3).
#
#   scripts/load-test.sh                  cargo test --workspace [--features mpi] --no-fail-fast
#   scripts/load-test.sh --python         python -m pytest python/tests -q
#                                         (python/tests/flare included: it is in the tree)
#   scripts/load-test.sh -- CMD ARGS...   any other command, e.g.
#                                         scripts/load-test.sh -- cargo test --test abort
#
# Options (before `--`):
#   --busy N     busy processes to start (default: 2 x nproc)
#   --python     run the Python suite instead of the Rust suite
#   --idle       start no busy process (the same command and report, for a baseline)
#
# The busy processes are `sh -c 'while :; do :; done'` loops in one process group of
# their own, started before the suite; a trap kills that group and reaps it on every
# exit of this script (the suite passing or failing, Ctrl-C, SIGTERM), so none outlives
# it. The venv at ${CARGO_TARGET_DIR:-target}/venv is put first on PATH (as
# scripts/test.sh does) so tests that drive python, torchrun or nvflare find them; this
# script installs nothing: run scripts/test.sh once first. Exit status: the suite's.
#
# Caveat: a loaded machine makes a suite slow, not only fragile; on 2 cores the Rust
# suite takes several times its idle duration (README "Development", CHANGELOG).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '==> load-test: %s\n' "$*" >&2; }
die() { printf 'load-test: error: %s\n' "$*" >&2; exit 2; }

CORES="$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
BUSY=$((2 * CORES))
SUITE=rust
CMD=()
while [ "$#" -gt 0 ]; do
    case "$1" in
        --busy)
            [ "$#" -ge 2 ] || die "--busy needs a number"
            case "$2" in '' | *[!0-9]*) die "--busy needs a number, not '$2'" ;; esac
            BUSY="$2"
            shift 2
            ;;
        --python) SUITE=python; shift ;;
        --idle) BUSY=0; shift ;;
        --) shift; SUITE=custom; CMD=("$@"); break ;;
        -h | --help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done

TARGET="${CARGO_TARGET_DIR:-target}"
if [ -x "$TARGET/venv/bin/python" ]; then
    VIRTUAL_ENV="$(cd "$TARGET/venv" && pwd)"
    export VIRTUAL_ENV
    export PATH="$VIRTUAL_ENV/bin:$PATH"
fi
case "$SUITE" in
    rust)
        FEATURES=()
        if command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
            FEATURES=(--features mpi)
        fi
        CMD=(cargo test --workspace "${FEATURES[@]}" --no-fail-fast)
        ;;
    python)
        [ -x "$TARGET/venv/bin/python" ] \
            || die "no venv at $TARGET/venv: run scripts/test.sh once first"
        CMD=(python -m pytest python/tests -q)
        ;;
    custom) [ "${#CMD[@]}" -gt 0 ] || die "'--' needs a command after it" ;;
esac

# --- The busy processes: one process group, killed and reaped on every exit ----------
BUSY_PGID=""
stop_busy() {
    if [ -n "$BUSY_PGID" ]; then
        kill -KILL -- "-$BUSY_PGID" 2>/dev/null || true
        wait "$BUSY_PGID" 2>/dev/null || true
        BUSY_PGID=""
    fi
}
SUITE_PID=""
# On a signal: stop the suite (its direct children too: cargo's test binary) and the
# busy loops, then exit with the signal's status.
stop_all() {
    if [ -n "$SUITE_PID" ]; then
        pkill -TERM -P "$SUITE_PID" 2>/dev/null || true
        kill -TERM "$SUITE_PID" 2>/dev/null || true
        wait "$SUITE_PID" 2>/dev/null || true
        SUITE_PID=""
    fi
    stop_busy
}
trap 'stop_busy' EXIT
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
trap 'stop_all; exit 129' HUP

if [ "$BUSY" -gt 0 ]; then
    # setsid puts the loops in a new session and process group whose id is the
    # leader's pid, so one kill reaches every loop and nothing else.
    setsid sh -c 'i=0; while [ "$i" -lt "$1" ]; do sh -c "while :; do :; done" & i=$((i + 1)); done; wait' \
        sh "$BUSY" </dev/null >/dev/null 2>&1 &
    BUSY_PGID=$!
    # Wait (bounded) until every loop runs, so the suite starts on a saturated machine.
    for _ in $(seq 100); do
        n="$(pgrep -g "$BUSY_PGID" -c 2>/dev/null || echo 0)"
        [ "$n" -ge $((BUSY + 1)) ] && break
        sleep 0.1
    done
    say "$BUSY busy processes on $CORES cores (process group $BUSY_PGID)"
else
    say "idle: no busy process"
fi

say "running: ${CMD[*]}"
start="$(date +%s)"
# In the background and waited on, so a signal to this script is handled at once (a
# foreground command would delay the trap until it ended).
set +e
"${CMD[@]}" &
SUITE_PID=$!
wait "$SUITE_PID"
rc=$?
SUITE_PID=""
set -e
end="$(date +%s)"
stop_busy
secs=$((end - start))
verdict=passed
[ "$rc" -eq 0 ] || verdict="FAILED (exit $rc)"
say "$verdict in ${secs} s ($((secs / 60)) min $((secs % 60)) s) with $BUSY busy processes on $CORES cores: ${CMD[*]}"
exit "$rc"
