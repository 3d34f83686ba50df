#!/usr/bin/env bash
# The steps of a provisioned FLARE deployment on one machine (docs/flare-production.md):
# provision the kits, put rankexec's classes on every kit's allow-list, write the
# clients' site policy, start each kit. python/tests/flare/test_provisioned.py runs this
# file (with its own folders and free ports) before its jobs. Each setting below has
# the default the page states; run it from the folder that holds project.yml, in the
# sites' Python environment: `bash examples/flare/production/site-steps.sh`.
set -euo pipefail

PROJECT_YML=${PROJECT_YML:-project.yml}
WS=${WS:-ws}
KIT=${KIT:-$WS/rxprod/prod_00}        # the kits `nvflare provision` writes
SERVER=${SERVER:-server1.example.com}
SITES=${SITES:-hospital-a hospital-b}
COMPONENT=${COMPONENT:-/opt/site-ranks/np_delta.py:AddDelta}   # the site's own rank code
PROVISION_ARGS=${PROVISION_ARGS:-}    # e.g. `--force`

# shellcheck disable=SC2086  # PROVISION_ARGS is a list of words
nvflare provision -p "$PROJECT_YML" -w "$WS" $PROVISION_ARGS
for kit in $SERVER $SITES; do
    python -m rankexec.flare allow-list "$KIT/$kit"   # local/resources.json
done
for site in $SITES; do
    python -m rankexec.flare policy "$KIT/$site" --component "$COMPONENT"
done
for kit in $SERVER $SITES; do
    (cd "$KIT/$kit" && bash startup/start.sh)   # each on its own machine in production
done
