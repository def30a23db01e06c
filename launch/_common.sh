# Sourced by the per-role scripts: find the pdserve command (the repo's .venv first).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -n "${PDSERVE:-}" ]; then
  pdserve="$PDSERVE"
elif [ -x "$here/../.venv/bin/pdserve" ]; then
  pdserve="$here/../.venv/bin/pdserve"
else
  pdserve="$(command -v pdserve)" || { echo "pdserve not found: run 'make venv'" >&2; exit 1; }
fi
