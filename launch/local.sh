#!/usr/bin/env bash
# Every role on this machine: SmolLM2-135M-Instruct (pulled on first use), 1 prefill + 1 decode,
# port 8000.
#   launch/local.sh [--prefill N --decode M --mode disagg|colocated --model DIR --port P]
set -euo pipefail
source "$(dirname "$0")/_common.sh"
[ "${1:-}" = serve ] && shift  # `local.sh serve ...` and `local.sh ...` both work
exec "$pdserve" serve "$@"
