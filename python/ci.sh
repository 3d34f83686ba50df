#!/usr/bin/env bash
# The Python part of CI, from a fresh clone: a virtual environment in target/venv with
# torch, scikit-learn, maturin and pytest; this package built into it; the release
# binaries the tests drive; the lint gates; the pytest suite.
#   python/ci.sh            (PYTHON=python3.12 python/ci.sh to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-target/venv}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# torch from PyPI brings its CUDA wheels (about 5 GB, 45 s here) and runs without a GPU.
"$VENV/bin/pip" install -q -r python/requirements-test.txt
VIRTUAL_ENV="$PWD/$VENV" "$VENV/bin/maturin" develop --release -m python/Cargo.toml
cargo build --release    # rankexec, rankexec-worker, rankexec-pydriver

"$VENV/bin/python" -m ruff check python examples/python benchmarks/python examples/flare benchmarks/flare
"$VENV/bin/python" -m ruff format --check python examples/python benchmarks/python examples/flare benchmarks/flare

# The stubs match the extension module.
(cd python && "../$VENV/bin/python" -m mypy.stubtest rankexec._rankexec --allowlist stubtest-allowlist.txt && "../$VENV/bin/python" -m mypy -p rankexec --ignore-missing-imports)

# The ranks' program is the `python` on PATH: this environment's (torchrun too).
PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/python" -m pytest python/tests -q
