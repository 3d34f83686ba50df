#!/usr/bin/env bash
# Runs the Rust suite and the fast Python tests N times idle and N times with every core
# saturated, and prints every test that failed at least once: a table of the test, its
# failures idle and its failures loaded (issue 32). A test that fails once in ten runs
# fails someone's CI every few days; this finds it before they do.
#
#   scripts/flake-check.sh [OPTIONS] N
#
# Options:
#   --rust-only            skip the Python tests
#   --python-only          skip the Rust suite
#   --rust ARGS            what follows `cargo test` (one shell word list), instead of
#                          `--workspace [--features mpi] --no-fail-fast`; e.g.
#                          --rust "--test signal_reset --test abort --no-fail-fast"
#   --python ARGS          what follows `python -m pytest -q -rfE -n 3 --dist loadfile`
#                          (RANKEXEC_PYTEST_WORKERS sets the 3; 0 runs serially), instead of the fast
#                          Python tests: python/tests without flare/, flower/,
#                          test_wheel.py and test_docs.py (those start nvflare, flwr, a
#                          wheel build, mkdocs: minutes each)
#   --busy N               busy processes when loaded (default: scripts/load-test.sh's,
#                          2 x nproc)
#
# Each run goes through scripts/load-test.sh (--idle, or with its busy loops, which it
# kills on every exit), in the order rust idle, rust loaded, python idle, python loaded,
# N times, so load from elsewhere on the machine is spread over both columns. Every run
# carries its own RXTEST_SUITE tag and is followed by scripts/leak-check.sh --kill: a
# process that outlived a run is a failure too, listed as `leak: <suite>`. A run that
# failed without naming a test (a test binary that crashed, a collection error) is
# listed by what cargo or pytest named. Logs: target/flake-check/STAMP/ (one per run,
# and the table in table.txt). Exit status: 0 when nothing failed, 1 otherwise.
#
# The venv at ${CARGO_TARGET_DIR:-target}/venv is used as scripts/test.sh made it (run
# that once first); the Rust suite needs the debug build of the workspace's binaries,
# which `cargo test --workspace` makes. Duration: N x (the Rust suite idle + loaded +
# the fast Python tests idle + loaded); on 2 cores the Rust suite alone takes about 7
# minutes idle and 12 loaded, so `--rust` with a list of test targets is how a short
# check is made.
#
# RANKEXEC_DRY_RUN=1: parse the arguments as usual and check them (N, the venv, each
# `--test TARGET` of --rust names a test target, each path of --python exists), print
# one `dry run: ...` line per run it would make, in order, and exit 0 without running
# anything or writing a log (python/tests/test_docs.py runs docs/testing.md's commands so).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '==> flake-check: %s\n' "$*" >&2; }
die() { printf 'flake-check: error: %s\n' "$*" >&2; exit 2; }

RUST=1
PY=1
RUST_ARGS=""
PY_ARGS=""
BUSY_ARGS=()
N=""
while [ "$#" -gt 0 ]; do
    case "$1" in
        --rust-only) PY=0; shift ;;
        --python-only) RUST=0; shift ;;
        --rust) [ "$#" -ge 2 ] || die "--rust needs arguments"; RUST_ARGS="$2"; shift 2 ;;
        --python) [ "$#" -ge 2 ] || die "--python needs arguments"; PY_ARGS="$2"; shift 2 ;;
        --busy) [ "$#" -ge 2 ] || die "--busy needs a number"; BUSY_ARGS=(--busy "$2"); shift 2 ;;
        -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        -*) die "unknown option '$1' (see --help)" ;;
        *) [ -z "$N" ] || die "one N only"; N="$1"; shift ;;
    esac
done
case "$N" in '' | *[!0-9]* | 0) die "N (runs of each kind, >= 1) is needed: $0 N" ;; esac

TARGET="${CARGO_TARGET_DIR:-target}"
if [ -z "$RUST_ARGS" ]; then
    RUST_ARGS="--workspace --no-fail-fast"
    if command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
        RUST_ARGS="--workspace --features mpi --no-fail-fast"
    fi
fi
if [ -z "$PY_ARGS" ]; then
    PY_ARGS="python/tests --ignore=python/tests/flare --ignore=python/tests/flower"
    PY_ARGS+=" --ignore=python/tests/test_wheel.py --ignore=python/tests/test_docs.py"
fi
if [ "$PY" = 1 ]; then
    [ -x "$TARGET/venv/bin/python" ] || die "no venv at $TARGET/venv: run scripts/test.sh once first"
fi
DRY="${RANKEXEC_DRY_RUN:-0}"
if [ "$DRY" = 1 ]; then
    # What a typo would only show minutes into the check: a test target or a path that
    # is not there, a --busy that is not a number.
    case "${BUSY_ARGS[1]:-1}" in '' | *[!0-9]*) die "--busy needs a number, not '${BUSY_ARGS[1]}'" ;; esac
    # shellcheck disable=SC2206  # word lists on purpose
    words=($RUST_ARGS)
    for ((k = 0; k < ${#words[@]}; k++)); do
        if [ "${words[k]}" = --test ]; then
            t="${words[k + 1]:-}"
            compgen -G "tests/$t.rs" >/dev/null || compgen -G "*/tests/$t.rs" >/dev/null \
                || die "--rust: no test target '$t' (tests/$t.rs)"
        fi
    done
    # shellcheck disable=SC2206
    words=($PY_ARGS)
    for w in "${words[@]}"; do
        case "$w" in -*) continue ;; */* | *.py) [ -e "${w%%::*}" ] || die "--python: no such path '$w'" ;; esac
    done
else
    OUT="$TARGET/flake-check/$(date -u +%Y%m%dT%H%M%SZ)"
    mkdir -p "$OUT"
    FAILS="$OUT/failures.tsv" # test <TAB> idle|loaded
    : >"$FAILS"
fi

# The command of a SUITE's runs (rust|python), into CMD.
suite_cmd() {
    if [ "$1" = rust ]; then
        # shellcheck disable=SC2206  # RUST_ARGS is a word list on purpose
        CMD=(cargo test $RUST_ARGS)
    else
        # shellcheck disable=SC2206
        # Three files at once, as scripts/test.sh runs them (RANKEXEC_PYTEST_WORKERS).
        CMD=(python -m pytest -q -rfE -p no:cacheprovider
            -n "${RANKEXEC_PYTEST_WORKERS:-3}" --dist loadfile $PY_ARGS)
    fi
}

# The failures one run's log names, one per line.
rust_failures() {
    # `Running tests/x.rs (...)` names the target of the `test NAME ... FAILED` lines
    # after it; a target that failed without such a line is named by cargo's summary.
    awk '
        /^ *Running / { t = $2; sub(/^(tests|src|benches)\//, "", t); sub(/\.rs$/, "", t); next }
        /^ *Doc-tests / { t = "doc:" $2; next }
        /^test .* \.\.\. FAILED$/ { n = $2; print t "::" n; named[t] = 1; next }
        /^test result: FAILED/ || /^error: test failed, to rerun pass/ { failed[t] = 1 }
        END { for (x in failed) if (!(x in named)) print x " (no test named)" }
    ' "$1"
    # Cargo stops before any test when the build fails.
    if grep -q '^error\(\[E[0-9]*\]\)\?: could not compile' "$1"; then echo "build failed"; fi
}
py_failures() {
    sed -n 's/^\(FAILED\|ERROR\) \([^ ]*\).*/\2/p' "$1"
    grep -q '^Interrupted: ' "$1" && echo "pytest interrupted (collection error)" || true
}

# One run: SUITE (rust|python), MODE (idle|loaded), I.
run_one() {
    local suite=$1 mode=$2 i=$3 log rc tag load=()
    log="$OUT/$suite-$mode-$i.log"
    tag="flake-$suite-$mode-$i-$$"
    [ "$mode" = idle ] && load=(--idle) || load=("${BUSY_ARGS[@]}")
    suite_cmd "$suite"
    say "$suite $mode run $i/$N: ${CMD[*]} (log $log)"
    set +e
    RXTEST_SUITE="$tag" scripts/load-test.sh "${load[@]}" -- "${CMD[@]}" >"$log" 2>&1
    rc=$?
    set -e
    tail -n 1 "$log" >&2
    {
        if [ "$suite" = rust ]; then rust_failures "$log"; else py_failures "$log"; fi
    } | sort -u | while IFS= read -r t; do
        [ -n "$t" ] && printf '%s\t%s\n' "$t" "$mode" >>"$FAILS"
    done
    if ! scripts/leak-check.sh --kill "$tag" 2>>"$log"; then
        printf 'leak: %s (see %s)\n' "$suite" "$log" >&2
        printf 'leak: %s\t%s\n' "$suite" "$mode" >>"$FAILS"
    fi
    # A failed run that named nothing is still a failure.
    if [ "$rc" -ne 0 ] && [ -z "$(if [ "$suite" = rust ]; then rust_failures "$log"; else py_failures "$log"; fi)" ]; then
        printf '%s run failed (exit %s), no test named\t%s\n' "$suite" "$rc" "$mode" >>"$FAILS"
    fi
}

if [ -x "$TARGET/venv/bin/python" ]; then
    VIRTUAL_ENV="$(cd "$TARGET/venv" && pwd)"
    export VIRTUAL_ENV PATH="$VIRTUAL_ENV/bin:$PATH"
fi
# The table after DONE rounds (also written after each round, so a check stopped early
# still leaves what it found in table.txt).
table() {
    local done=$1 secs=$(($(date +%s) - start))
    echo "flake check: $done runs idle and $done loaded of each suite (of $N), $((secs / 60)) min $((secs % 60)) s"
    [ "$RUST" = 1 ] && echo "  rust:   cargo test $RUST_ARGS"
    [ "$PY" = 1 ] && echo "  python: python -m pytest -q -rfE $PY_ARGS"
    if [ ! -s "$FAILS" ]; then
        echo "no test failed"
    else
        awk -F'\t' '
            { k = $1; if ($2 == "idle") idle[k]++; else loaded[k]++; seen[k] = 1 }
            END {
                printf "%-90s %6s %6s\n", "test", "idle", "loaded"
                for (k in seen) printf "%-90s %6d %6d\n", k, idle[k] + 0, loaded[k] + 0
            }
        ' "$FAILS" | { read -r head; echo "$head"; sort; }
    fi
}

start="$(date +%s)"
for i in $(seq "$N"); do
    for suite in rust python; do
        [ "$suite" = rust ] && [ "$RUST" = 0 ] && continue
        [ "$suite" = python ] && [ "$PY" = 0 ] && continue
        for mode in idle loaded; do
            if [ "$DRY" = 1 ]; then
                suite_cmd "$suite"
                echo "dry run: $suite $mode run $i/$N: ${CMD[*]}"
            else
                run_one "$suite" "$mode" "$i"
            fi
        done
    done
    [ "$DRY" = 1 ] || table "$i" >"$OUT/table.txt"
done
[ "$DRY" = 1 ] && exit 0
cat "$OUT/table.txt"
[ ! -s "$FAILS" ]
