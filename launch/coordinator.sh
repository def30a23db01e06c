#!/usr/bin/env bash
# One coordinator per cluster. Other nodes reach it at tcp://<this host>:<port>.
#   launch/coordinator.sh [--bind tcp://0.0.0.0:5550] [pdserve coordinator flags...]
# Keys: PDSERVE_KEYS=DIR (one node's directory from `pdserve keygen`), or --keys DIR; its
# identity must hold the coordinator role (`pdserve keygen --nodes NAME:coordinator`).
set -euo pipefail
source "$(dirname "$0")/_common.sh"
exec "$pdserve" coordinator --bind "${PDSERVE_COORDINATOR_BIND:-tcp://0.0.0.0:5550}" "$@"
