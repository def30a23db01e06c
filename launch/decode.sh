#!/usr/bin/env bash
# A decode worker on this node (add --colocated for a worker that runs both phases).
#   PDSERVE_COORDINATOR=tcp://coord-host:5550 launch/decode.sh --model DIR \
#     [--control-bind tcp://0.0.0.0:0 --transfer-bind tcp://0.0.0.0:0 \
#      --advertise-host THIS_HOST] [flags...]
# Keys: PDSERVE_KEYS=DIR (one node's directory from `pdserve keygen`), or --keys DIR; its
# identity must hold the decode role (`pdserve keygen --nodes NAME:decode`), a colocated
# worker's both worker roles (NAME:prefill+decode).
set -euo pipefail
source "$(dirname "$0")/_common.sh"
: "${PDSERVE_COORDINATOR:?set PDSERVE_COORDINATOR to the coordinator address}"
exec "$pdserve" decode --coordinator "$PDSERVE_COORDINATOR" "$@"
