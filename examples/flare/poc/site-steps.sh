#!/usr/bin/env bash
# The site steps of a FLARE POC deployment (docs/flare-admins.md): prepare the kits,
# put rankexec's classes on every site's allow-list, write the clients' site policy,
# then start. python/tests/flare/test_poc.py runs this file (with its own folders and
# free ports) before its jobs. Each setting below has the default the page states.
# Run it in the site's Python environment: `bash examples/flare/poc/site-steps.sh`,
# or `KIT=... SITES=... bash examples/flare/poc/site-steps.sh`.
set -euo pipefail

# POC's kits: `nvflare poc prepare -n 2` puts them here (NVFLARE_POC_WORKSPACE moves them).
KIT=${KIT:-/tmp/nvflare/poc/example_project/prod_00}
PREPARE_ARGS=${PREPARE_ARGS:--n 2}   # or `-i project.yml --force`; production: `nvflare provision`
SITES=${SITES:-site-1 site-2}
COMPONENT=${COMPONENT:-/opt/site-ranks/np_delta.py:AddDelta}   # the site's own rank code
ADMIN=${ADMIN:-admin@nvidia.com}
START_ARGS=${START_ARGS:-}           # e.g. `--timeout 120`

# shellcheck disable=SC2086  # the ARGS variables are lists of words
nvflare poc prepare $PREPARE_ARGS
for site in server $SITES; do
    python -m rankexec.flare allow-list "$KIT/$site" --dry-run   # prints the diff, writes nothing
    python -m rankexec.flare allow-list "$KIT/$site"             # writes local/resources.json
done
for site in $SITES; do
    python -m rankexec.flare policy "$KIT/$site" --component "$COMPONENT"
done
# shellcheck disable=SC2086
nvflare poc start -ex "$ADMIN" $START_ARGS   # production: restart each client with its start.sh
