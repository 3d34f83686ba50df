#!/usr/bin/env bash
# Builds the Python package's release wheel and its sdist: the wheel a site installs with
# `pip install rankexec-<version>-cp311-abi3-manylinux_2_17_x86_64...whl` and no Rust.
#
#   scripts/wheel.sh [--profile PROFILE] [--out DIR]
#
# The wheel holds the extension module (abi3: CPython 3.11 and newer), the Python
# package, its type stubs, and in rankexec/_bin/ the `rankexec` command line (built
# without the example trainers: `--no-default-features`) and the Rust rank program
# `rankexec-worker`. Installing it gives the `rankexec` command.
#
# Everything is linked with zig against glibc 2.17 (maturin's `--zig` and cargo-zigbuild,
# both from PyPI), so the wheel is manylinux2014 (manylinux_2_17) whatever glibc the
# build machine has. A plain build on Debian 12 (glibc 2.36) needs GLIBC_2.34 symbols
# (pthread_*, dlopen, __libc_start_main), which would allow manylinux_2_34 at best and
# shut out RHEL 8/9-era clusters (glibc 2.28/2.34) and Ubuntu 20.04 (2.31).
#
#   --profile  the cargo profile: `wheel` (default: fat LTO, stripped) or `wheel-test`
#              (no LTO, opt-level 0: what python/tests/test_wheel.py builds to keep
#              CI short)
#   --out      where the wheel and sdist go (default: ${CARGO_TARGET_DIR:-target}/wheels)
# RANKEXEC_WHEEL_PROFILE and RANKEXEC_WHEEL_OUT set the same defaults, so that
# python/tests/test_wheel.py runs the command docs/development.md shows as written.
#
# The build tools (maturin, ziglang, cargo-zigbuild, auditwheel, pinned below) are
# installed once into ${CARGO_TARGET_DIR:-target}/wheel-tools, a virtual environment of
# its own (PYTHON picks the interpreter that makes it; 3.11 or newer). Needs Rust (the
# toolchain of rust-toolchain.toml) and network access to PyPI the first time only.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

PROFILE="${RANKEXEC_WHEEL_PROFILE:-wheel}"
TARGET_DIR="${CARGO_TARGET_DIR:-target}"
OUT="${RANKEXEC_WHEEL_OUT:-$TARGET_DIR/wheels}"
while [ $# -gt 0 ]; do
    case "$1" in
        --profile) PROFILE="${2:?--profile needs a value}"; shift 2 ;;
        --out) OUT="${2:?--out needs a value}"; shift 2 ;;
        -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
case "$PROFILE" in wheel|wheel-test) ;; *) die "--profile is wheel or wheel-test, not $PROFILE" ;; esac

# glibc 2.17 is manylinux2014: the oldest glibc Rust's std supports.
GLIBC=2.17
POLICY=manylinux2014
ARCH="$(uname -m)"
TRIPLE="$ARCH-unknown-linux-gnu"
TOOL_PINS="maturin==1.16.0 ziglang==0.17.0 cargo-zigbuild==0.24.0 auditwheel==6.8.2"

# --- the build tools ------------------------------------------------------------------
TOOLS="$TARGET_DIR/wheel-tools"
if [ ! -x "$TOOLS/bin/python" ]; then
    PY="${PYTHON:-}"
    if [ -z "$PY" ]; then
        if command -v python3.11 >/dev/null; then PY=python3.11; else PY=python3; fi
    fi
    command -v "$PY" >/dev/null || die "$PY not found (Python 3.11 or newer is needed)"
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "$PY is $("$PY" --version 2>&1); Python 3.11 or newer is needed"
    say "creating $TOOLS for the build tools"
    "$PY" -m venv "$TOOLS"
fi
TOOLS="$(cd "$TOOLS" && pwd)"
if [ "$(cat "$TOOLS/.pins" 2>/dev/null || true)" != "$TOOL_PINS" ]; then
    say "installing $TOOL_PINS into $TOOLS"
    # shellcheck disable=SC2086  # one argument per pin
    "$TOOLS/bin/python" -m pip install -q --disable-pip-version-check $TOOL_PINS
    echo "$TOOL_PINS" >"$TOOLS/.pins"
fi
# cargo-zigbuild and maturin find zig as `python3 -m ziglang` of this environment.
export PATH="$TOOLS/bin:$PATH"

# --- the binaries, as package data ----------------------------------------------------
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
BIN_STAGE=python/rankexec/_bin
# The staged binaries exist only while the wheel is built: a later `maturin develop`
# must not install stale ones.
trap 'rm -rf "$BIN_STAGE"' EXIT
rm -rf "$BIN_STAGE"
# cargo-zigbuild and maturin's zig each link through a wrapper of their own, and cargo
# rebuilds everything when the linker changes: each gets a target folder of its own, so
# a second build is incremental.
BIN_TARGET="$TARGET_DIR/wheel-build/bins"
EXT_TARGET="$TARGET_DIR/wheel-build/ext"
say "cargo zigbuild --profile $PROFILE --target $TRIPLE.$GLIBC: rankexec (no examples), rankexec-worker"
CARGO_TARGET_DIR="$BIN_TARGET" cargo zigbuild --locked --profile "$PROFILE" \
    --target "$TRIPLE.$GLIBC" -p rankexec -p rankexec-sub-worker --no-default-features \
    --bin rankexec --bin rankexec-worker
mkdir -p "$BIN_STAGE"
for b in rankexec rankexec-worker; do
    install -m 0755 "$BIN_TARGET/$TRIPLE/$PROFILE/$b" "$BIN_STAGE/$b"
done

# --- the wheel and the sdist ----------------------------------------------------------
rm -f "$OUT"/rankexec-*.whl "$OUT"/rankexec-*.tar.gz
say "maturin build --profile $PROFILE --zig --compatibility $POLICY"
CARGO_TARGET_DIR="$EXT_TARGET" maturin build --locked --profile "$PROFILE" --zig \
    --target "$TRIPLE" --compatibility "$POLICY" -m python/Cargo.toml --out "$OUT"
say "maturin sdist"
maturin sdist -m python/Cargo.toml --out "$OUT"

WHEEL="$(compgen -G "$OUT/rankexec-*.whl")" || die "maturin made no wheel in $OUT"
SDIST="$(compgen -G "$OUT/rankexec-*.tar.gz")" || die "maturin made no sdist in $OUT"
say "auditwheel show (every ELF file in the wheel, the binaries included)"
auditwheel show "$WHEEL"
size() { stat -c %s "$1" | awk '{printf "%.1f MiB", $1 / 1048576}'; }
echo "wheel: $WHEEL ($(size "$WHEEL"))"
echo "sdist: $SDIST ($(size "$SDIST"))"
echo "built in $((SECONDS - START)) s (profile $PROFILE)"
