#!/usr/bin/env bash
# llama.cpp's `llama-server`, built from the source vendored in PyPI's llama-cpp-python sdist
# (vendor/llama.cpp): bench/experiments/peers/compare.py runs it beside pdserve and vLLM.
# The sdist is the only download; cmake builds with no network (no curl, no OpenSSL, no
# prebuilt web UI, no KleidiAI). Idempotent; about 10 minutes on 2 cores the first time.
#   bench/experiments/peers/setup_llamacpp.sh [DIR]        (default .peers/llamacpp)
# -> DIR/bin/llama-server (static, this CPU's instruction set: GGML_NATIVE=ON), DIR/VERSION
set -euo pipefail
cd "$(dirname "$0")/../../.."
dir=${1:-.peers/llamacpp}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
jobs=${JOBS:-$(nproc)}
server="$dir/bin/llama-server"
if [ -x "$server" ] && "$server" --version >/dev/null 2>&1; then
    echo "llama-server already in $dir: $(cat "$dir/VERSION" 2>/dev/null)"; exit 0
fi
if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get install -y -q cmake build-essential >/dev/null 2>&1 ||
            { apt-get update -q >/dev/null && apt-get install -y -q cmake build-essential >/dev/null; }
    else
        echo "cmake and a C++ compiler are needed (apt-get install cmake build-essential)" >&2
        exit 1
    fi
fi
mkdir -p "$dir/bin"
src="$dir/llama_cpp_python-$version"
if [ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
    python3 -m pip download -q --no-binary :all: --no-deps -d "$dir" "llama-cpp-python==$version"
    tar -xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir"
fi
cpp="$src/vendor/llama.cpp"
# the sdist keeps the submodule's git directory: the commit the build reports
commit=$(git -C "$cpp" rev-parse --short HEAD 2>/dev/null || echo unknown)
cmake -S "$cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_LLGUIDANCE=OFF -DGGML_CPU_KLEIDIAI=OFF >"$dir/cmake.log"
cmake --build "$dir/build" --config Release -j"$jobs" --target llama-server >"$dir/build.log"
cp "$dir/build/bin/llama-server" "$server"
built=$("$server" --version 2>&1 | grep -m1 -i version || true)
echo "llama-cpp-python $version sdist, llama.cpp commit $commit: $built" >"$dir/VERSION"
echo "llama-server in $dir: $(cat "$dir/VERSION")"
