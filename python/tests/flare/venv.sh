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
# The simulator is started as `nvflare`, and torchrun as `torchrun`, next to the
# interpreter: both run with this venv's Python.
write_entry() {  # NAME MODULE FUNCTION
  cat > "$venv/bin/$1" <<PY
#!$venv/bin/python
import sys
from $2 import $3
if __name__ == "__main__":
    sys.exit($3())
PY
  chmod +x "$venv/bin/$1"
}
write_entry nvflare nvflare.cli main
write_entry torchrun torch.distributed.run main
cd "$repo/python"
VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" "$base/bin/maturin" develop --release --quiet
"$venv/bin/python" -c 'import rankexec, nvflare; print("rankexec", rankexec.__file__, "| nvflare", nvflare.__version__)'
