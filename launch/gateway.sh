#!/usr/bin/env bash
# An OpenAI-compatible gateway; run as many as you like behind an HTTP load balancer.
#   PDSERVE_COORDINATOR=tcp://coord-host:5550 launch/gateway.sh [--host 0.0.0.0 --port 8000]
# Keys: PDSERVE_KEYS=DIR (one node's directory from `pdserve keygen`), or --keys DIR; its
# identity must hold the gateway role (`pdserve keygen --nodes NAME:gateway`).
set -euo pipefail
source "$(dirname "$0")/_common.sh"
: "${PDSERVE_COORDINATOR:?set PDSERVE_COORDINATOR to the coordinator address}"
exec "$pdserve" gateway --coordinator "$PDSERVE_COORDINATOR" "$@"
