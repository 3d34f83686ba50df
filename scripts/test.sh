#!/usr/bin/env bash
# The test command: installs what the tests need, then runs every test.
#
#   scripts/test.sh [ARGS...]      ARGS go to `cargo test` (for example `-- --nocapture`)
#
# On a fresh machine with only Rust and Python 3.11 it:
#   1. installs Open MPI and libclang with apt-get when they are missing and it may
#      (root, or `sudo -n` works); otherwise it names the packages and runs the tests
#      without `--features mpi`;
#   2. makes a virtual environment at ${CARGO_TARGET_DIR:-target}/venv (reused while
#      python/requirements-test.txt and the Python version are unchanged: a stamp file
#      records them), installs python/requirements-test.txt into it, then the package in
#      python/ (`maturin develop --release`);
#   3. runs `cargo test --workspace [--features mpi]` with the venv's bin first on PATH
#      (tests that drive python or torchrun find them there);
#   4. runs scripts/slurm-test.sh (srun under a real single-machine Slurm cluster; it
#      prints `SKIPPED: <reason>` where it cannot run: not root, packages missing);
#   5. builds the release binaries the Python tests drive, runs `python -m pytest
#      python/tests -q` (python/tests/flare runs the real `nvflare simulator`;
#      python/tests/test_wheel.py builds the wheel with scripts/wheel.sh and tests it in
#      a clean venv; python/tests/test_docs.py builds the guide, docs/, with `mkdocs
#      build --strict` and runs or checks every block of README.md and docs/), then
#      ruff, mypy's stubtest and mypy on the Python sources.
#   6. after the Rust tests and again at the end (or on a failure), fails when a
#      process the suite started is still alive, naming it, and kills it
#      (scripts/leak-check.sh: every such process carries RXTEST_SUITE, a tag this
#      script sets).
#
# Environment:
#   RANKEXEC_SKIP_PY=1     skip the Python part (no venv, no pytest, no ruff)
#   RANKEXEC_NO_INSTALL=1  never install system packages
#   RANKEXEC_PYTEST_WORKERS=N  test files pytest runs at once (default 3; 0: serially)
#   PYTHON=python3.11      the interpreter that makes the venv (default: python3.11,
#                          else python3 if it is 3.11 or newer)
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Every process the suite starts inherits this tag; none may outlive the suite.
export RXTEST_SUITE="${RXTEST_SUITE:-suite-$(date +%s)-$$}"
on_exit() {
    local rc=$?
    # A failed run still names and kills what it left behind.
    if [ "$rc" -ne 0 ]; then scripts/leak-check.sh --kill "$RXTEST_SUITE" || true; fi
    exit "$rc"
}
trap on_exit EXIT

TARGET="${CARGO_TARGET_DIR:-target}"
MPI_PACKAGES="libopenmpi-dev openmpi-bin libclang1-14 libclang-common-14-dev"

# --- 1. Open MPI and libclang (bindgen) for the `mpi` feature -------------------------
have_libclang() {
    [ -n "${LIBCLANG_PATH:-}" ] && return 0
    ldconfig -p 2>/dev/null | grep -q 'libclang\(-[0-9.]*\)\?\.so' && return 0
    compgen -G '/usr/lib/llvm-*/lib/libclang.so*' >/dev/null \
        || compgen -G '/usr/lib/llvm-*/lib/libclang-[0-9]*.so*' >/dev/null
}
have_mpi() {
    command -v mpicc >/dev/null && command -v mpirun >/dev/null && have_libclang
}

if ! have_mpi; then
    SUDO=none
    if [ "$(id -u)" -eq 0 ]; then
        SUDO=""
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    fi
    if [ "$SUDO" != none ] && command -v apt-get >/dev/null && [ "${RANKEXEC_NO_INSTALL:-0}" != 1 ]; then
        say "installing Open MPI and libclang: apt-get install $MPI_PACKAGES"
        # shellcheck disable=SC2086  # $SUDO is empty or `sudo -n`
        $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        # shellcheck disable=SC2086
        $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends $MPI_PACKAGES >/dev/null
    fi
fi
FEATURES=()
if have_mpi; then
    FEATURES=(--features mpi)
else
    say "Open MPI or libclang is missing and cannot be installed here" \
        "(install: apt-get install $MPI_PACKAGES); running without --features mpi"
fi

# --- 2. The Python environment ---------------------------------------------------------
PY_TESTS=0
if [ "${RANKEXEC_SKIP_PY:-0}" = 1 ]; then
    say "RANKEXEC_SKIP_PY=1: skipping the Python part"
else
    PY_TESTS=1
    VENV="$TARGET/venv"
    if [ ! -x "$VENV/bin/python" ]; then
        PY="${PYTHON:-}"
        if [ -z "$PY" ]; then
            if command -v python3.11 >/dev/null; then PY=python3.11; else PY=python3; fi
        fi
        command -v "$PY" >/dev/null || die "$PY not found (Python 3.11 or newer is needed; RANKEXEC_SKIP_PY=1 skips the Python part)"
        "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
            || die "$PY is $("$PY" --version 2>&1); Python 3.11 or newer is needed"
        say "creating the virtual environment $VENV"
        "$PY" -m venv "$VENV"
    fi
    VENV="$(cd "$VENV" && pwd)"
    STAMP="$VENV/.rankexec-requirements"
    want="$({ "$VENV/bin/python" --version; cat python/requirements-test.txt; } | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$want" ]; then
        say "installing python/requirements-test.txt into $VENV (torch brings CUDA wheels: a few GB)"
        "$VENV/bin/python" -m pip install -q --upgrade pip
        "$VENV/bin/python" -m pip install -q -r python/requirements-test.txt
        echo "$want" >"$STAMP"
    else
        say "reusing $VENV (requirements unchanged)"
    fi
    export VIRTUAL_ENV="$VENV"
    export PATH="$VENV/bin:$PATH"
    say "building the Python package into $VENV"
    maturin develop --release -q -m python/Cargo.toml
fi

# --- 3. Rust -----------------------------------------------------------------------------
say "cargo test --workspace ${FEATURES[*]:-}"
cargo test --workspace "${FEATURES[@]}" "$@"
say "no process of the Rust tests outlives them (scripts/leak-check.sh)"
scripts/leak-check.sh --kill "$RXTEST_SUITE"

# --- 3b. srun under a real Slurm (ranks in another network namespace: python/tests) ------
scripts/slurm-test.sh "${FEATURES[@]}"

# --- 4. Python tests and lint --------------------------------------------------------------
if [ "$PY_TESTS" = 1 ]; then
    # The Python tests drive the release binaries (rankexec, rankexec-worker,
    # rankexec-pydriver); python/tests/flare runs the real `nvflare simulator`.
    say "cargo build --release --workspace --bins (the binaries the Python tests drive)"
    cargo build --release --workspace --bins
    if compgen -G 'python/tests/test_*.py' >/dev/null || compgen -G 'python/tests/*_test.py' >/dev/null; then
        # Three files at once (pytest-xdist; a file's tests stay together, so a module's
        # deployment is set up once): most tests wait on FLARE's and Flower's polling,
        # and the suite takes about half its serial time on 2 cores.
        # RANKEXEC_PYTEST_WORKERS=0 runs it serially.
        WORKERS="${RANKEXEC_PYTEST_WORKERS:-3}"
        XDIST=()
        if [ "$WORKERS" != 0 ]; then XDIST=(-n "$WORKERS" --dist loadfile); fi
        say "python -m pytest python/tests -q ${XDIST[*]:-}"
        python -m pytest python/tests -q "${XDIST[@]}" --durations=40
    else
        say "no Python tests in python/tests"
    fi
    LINT=()
    for d in python examples/python examples/flare examples/flower benchmarks/python benchmarks/flare benchmarks/flower; do
        [ -d "$d" ] && LINT+=("$d")
    done
    if [ "${#LINT[@]}" -gt 0 ]; then
        say "ruff check / ruff format --check ${LINT[*]}"
        ruff check "${LINT[@]}"
        ruff format --check "${LINT[@]}"
    fi
    # The type stubs match the extension module, and the package type-checks.
    say "mypy.stubtest rankexec._rankexec; mypy -p rankexec"
    (cd python && python -m mypy.stubtest rankexec._rankexec --allowlist stubtest-allowlist.txt \
        && python -m mypy -p rankexec --ignore-missing-imports)
fi
say "no process of the suite outlives it (scripts/leak-check.sh)"
scripts/leak-check.sh --kill "$RXTEST_SUITE"
say "all tests passed"
