#!/usr/bin/env bash
# A prefill worker on this node.
#   PDSERVE_COORDINATOR=tcp://coord-host:5550 launch/prefill.sh --model DIR \
#     [--control-bind tcp://0.0.0.0:0 --advertise-host THIS_HOST] [flags...]
# Keys: PDSERVE_KEYS=DIR (one node's directory from `pdserve keygen`), or --keys DIR; its
# identity must hold the prefill role (`pdserve keygen --nodes NAME:prefill`).
set -euo pipefail
source "$(dirname "$0")/_common.sh"
: "${PDSERVE_COORDINATOR:?set PDSERVE_COORDINATOR to the coordinator address}"
exec "$pdserve" prefill --coordinator "$PDSERVE_COORDINATOR" "$@"
