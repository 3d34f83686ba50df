#!/usr/bin/env bash
# Fails when a process started by a test run outlives it: a host, a rank, a launcher,
# an nvflare or flwr process a test forgot (issue 32).
#
#   scripts/leak-check.sh [--kill] TAG
#
# scripts/test.sh exports RXTEST_SUITE=TAG (a value of its own) before it runs any
# test; every process the suite starts inherits it in its environment, which
# /proc/PID/environ keeps as it was at exec whatever the process does later. This
# lists every live process whose environment holds RXTEST_SUITE=TAG, except this
# script's own ancestors (the test run that calls it), prints one line per process
# (pid, parent, command line) and exits 1; it exits 0 when there is none. With
# --kill it then SIGKILLs each one it named, checking first that the pid still holds
# the tag (a pid is never signalled on an old reading). Processes of another run (a
# colleague's suite on the same machine) have another tag and are left alone.
#
# Caveats: the tag is not named RANKEXEC_*, because the executor strips its own
# variables from ranks; a rank whose configuration sets `env.inherit: false` (and does
# not allow RXTEST_SUITE) does not carry it, nor does anything started with a cleared
# environment: those are not seen here.
set -euo pipefail

KILL=0
if [ "${1:-}" = --kill ]; then KILL=1; shift; fi
TAG="${1:-}"
[ -n "$TAG" ] || { echo "usage: $0 [--kill] TAG" >&2; exit 2; }
# This script's own children (the tools below) must not carry the tag.
unset RXTEST_SUITE
WANT="RXTEST_SUITE=$TAG"

# Our ancestors carry the tag and are alive: they are the run, not its leftovers.
declare -A SKIP=()
pid=$$
while [ -n "$pid" ] && [ "$pid" -gt 1 ]; do
    SKIP[$pid]=1
    pid="$(awk '/^PPid:/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)"
done

zombie() {
    awk '/^State:/ {exit !($2 == "Z" || $2 == "X")}' "/proc/$1/status" 2>/dev/null
}

has_tag() {
    # One read of the environment; a process that is gone has no tag.
    { tr '\0' '\n' <"/proc/$1/environ"; } 2>/dev/null | grep -qxF "$WANT"
}

LEFT=()
for d in /proc/[0-9]*; do
    p="${d#/proc/}"
    [ -z "${SKIP[$p]:-}" ] || continue
    [ "$p" != "$$" ] || continue
    has_tag "$p" || continue
    # A zombie runs nothing and holds nothing but its pid (one whose parent died is
    # reaped by init; where init does not reap, as in some containers, it stays).
    zombie "$p" && continue
    LEFT+=("$p")
done

[ "${#LEFT[@]}" -gt 0 ] || exit 0
echo "error: ${#LEFT[@]} process(es) started by the test run (RXTEST_SUITE=$TAG) outlived it:" >&2
for p in "${LEFT[@]}"; do
    ppid="$(awk '/^PPid:/ {print $2}' "/proc/$p/status" 2>/dev/null || echo '?')"
    name="$(awk '/^(Name|State):/ {$1 = ""; printf "%s;", $0}' "/proc/$p/status" 2>/dev/null || true)"
    cmd="$({ tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null | cut -c1-200 || true)"
    echo "  pid $p (parent $ppid;${name:-}): ${cmd:-?}" >&2
done
if [ "$KILL" = 1 ]; then
    for p in "${LEFT[@]}"; do
        if has_tag "$p"; then kill -KILL "$p" 2>/dev/null || true; fi
    done
    echo "  (killed)" >&2
fi
exit 1
