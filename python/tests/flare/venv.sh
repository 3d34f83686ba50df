#!/usr/bin/env bash
# A private venv for the FLARE tests and the side-by-side benchmark: this checkout's
# rankexec package, over the packages of a base venv (nvflare, numpy, torch, ...).
#
#   python/tests/flare/venv.sh [BASE_VENV]      (default /work/venv, or $RANKEXEC_BASE_VENV)
#   target/flare-venv/bin/python -m pytest python/tests/flare
#
# Why: several checkouts may share one base venv, and `maturin develop` there
# installs whichever checkout ran last. The overlay sees the base venv's
# site-packages through a .pth file; its own `rankexec` comes first.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../../.." && pwd)"
base="${1:-${RANKEXEC_BASE_VENV:-/work/venv}}"
venv="$repo/target/flare-venv"
py="$base/bin/python"
site_base="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv --without-pip "$venv"
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$site_base" > "$site/zz_base_venv.pth"
# The simulator is started as `nvflare`, next to the interpreter.
cat > "$venv/bin/nvflare" <<PY
#!$venv/bin/python
import sys
from nvflare.cli import main
if __name__ == "__main__":
    sys.exit(main())
PY
chmod +x "$venv/bin/nvflare"
cd "$repo/python"
VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" "$base/bin/maturin" develop --release --quiet
"$venv/bin/python" -c 'import rankexec, nvflare; print("rankexec", rankexec.__file__, "| nvflare", nvflare.__version__)'
