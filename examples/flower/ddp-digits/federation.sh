#!/usr/bin/env bash
# A Flower federation of the ddp-digits example by hand (docs/flower.md, "The example"):
# a SuperLink and two SuperNodes under Flower's Deployment Engine, insecure, on this
# machine; `flwr run APP dep --stream` once both nodes are online; then every process
# it started is stopped, on success, on failure and on SIGINT/SIGTERM alike.
# python/tests/flower/test_deployment.py runs this file (its own FLWR_HOME, free
# ports, a run config). Each setting below has the default the page states.
# Run it in the SuperNodes' Python environment (rankexec's wheel, flwr, torch,
# scikit-learn): `bash examples/flower/ddp-digits/federation.sh`, or
# `LINK_PORT=... NODE_PORTS="... ..." bash examples/flower/ddp-digits/federation.sh`;
# another app on the same federation: `bash examples/flower/ddp-digits/federation.sh APP_DIR`
# (test_hf_trainer.py runs examples/flower/hf-trainer so).
set -euo pipefail

export FLWR_HOME=${FLWR_HOME:-$PWD/flwr-home}
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
APP=${1:-${APP:-examples/flower/ddp-digits}}   # the Flower app: the first argument, or APP
LINK_PORT=${LINK_PORT:-9100}          # the SuperLink's (flwr and the SuperNodes connect here)
NODE_PORTS=${NODE_PORTS:-9194 9195}   # one SuperNode per port, partition-id 0, 1, ...
RUN_CONFIG=${RUN_CONFIG:-}            # e.g. `num-server-rounds=3`: flwr run --run-config
START_TIMEOUT_S=${START_TIMEOUT_S:-90}  # for the nodes to be online
STOP_TIMEOUT_S=${STOP_TIMEOUT_S:-15}    # for each process to exit after SIGTERM

started=()
run_pid=""
stop_all() {
    local pid left t
    if [ -n "$run_pid" ]; then kill -TERM "$run_pid" 2>/dev/null || true; fi
    for pid in "${started[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${started[@]}"; do
        t=$((STOP_TIMEOUT_S * 10))
        while kill -0 "$pid" 2>/dev/null && ((t-- > 0)); do
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            echo "federation: pid $pid still running after SIGTERM: SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
        wait "$pid" 2>/dev/null || true
    done
    left=""
    for pid in "${started[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then left="$left $pid"; fi
    done
    echo "federation: stopped pids ${started[*]}${left:+ (still running:$left)}"
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p "$FLWR_HOME"
flower-superlink --insecure --disable-runtime-dependency-installation --port "$LINK_PORT" &
started+=($!)
echo "federation: superlink pid $!"
read -r -a ports <<<"$NODE_PORTS"
for i in "${!ports[@]}"; do
    flower-supernode --insecure --superlink "127.0.0.1:$LINK_PORT" --port "${ports[$i]}" \
        --node-config "partition-id=$i num-partitions=${#ports[@]}" &
    started+=($!)
    echo "federation: supernode $i pid $!"
done
printf '[superlink]\ndefault = "dep"\n[superlink.dep]\naddress = "127.0.0.1:%s"\ninsecure = true\n' \
    "$LINK_PORT" >"$FLWR_HOME/config.toml"

# Until every SuperNode is online (`flwr supernode ls`), each process still running.
deadline=$((SECONDS + START_TIMEOUT_S))
until [ "$(flwr supernode ls dep --format json 2>/dev/null | grep -c '"status": "online"')" \
    -ge "${#ports[@]}" ]; do
    for pid in "${started[@]}"; do
        kill -0 "$pid" 2>/dev/null || { echo "federation: pid $pid exited" >&2; exit 1; }
    done
    if ((SECONDS > deadline)); then
        echo "federation: the SuperNodes were not online after ${START_TIMEOUT_S}s" >&2
        exit 1
    fi
    sleep 0.5
done
echo "federation: ${#ports[@]} SuperNodes online"

# In the background and waited for, so that a signal to this script runs its trap at once.
flwr run "$APP" dep --stream ${RUN_CONFIG:+--run-config "$RUN_CONFIG"} &
run_pid=$!
echo "federation: flwr run pid $run_pid"
wait "$run_pid"
