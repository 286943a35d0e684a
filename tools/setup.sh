#!/usr/bin/env bash
# One command from a fresh clone to a working zipmoe: system packages, the native library, the
# Python package in .venv, then the demo: the main job on a built-in default (a SYNTHETIC MoE run under a
# memory budget of half its size, next to stock llama.cpp in the same limit, with the same tokens).
#   bash tools/setup.sh            everything, then the demo
#   bash tools/setup.sh --no-demo  everything but the demo
set -euo pipefail
cd "$(dirname "$0")/.."

run_demo=1
for arg in "$@"; do
    case "$arg" in
        --no-demo) run_demo=0 ;;
        -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown option $arg (try --help)" >&2; exit 2 ;;
    esac
done

step() { printf '\n==> %s\n' "$*"; }

# --- architecture: CMake picks the SIMD kernels that it has for it (ggml_zipmoe/CMakeLists.txt), each run only
# after a CPU check; no flag here depends on it
case "$(uname -m)" in
    x86_64|amd64) simd="AVX2 and AVX-512 kernels, each used where the CPU has it" ;;
    aarch64|arm64) simd="NEON kernels, used where the CPU has Advanced SIMD (README: ARM64)" ;;
    *) simd="portable code only: zipmoe has no SIMD kernels for this architecture" ;;
esac
step "architecture $(uname -m): $simd"

# --- system packages (Debian/Ubuntu); skipped when already present
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
{ command -v cc && command -v c++; } >/dev/null || need+=(build-essential)
[ -f /usr/include/zstd.h ] || need+=(libzstd-dev)
[ -f /usr/include/xxhash.h ] || need+=(libxxhash-dev)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
    step "installing system packages: ${need[*]}"
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    if ! command -v apt-get >/dev/null; then
        echo "setup.sh: please install ${need[*]} with your package manager, then run me again" >&2
        exit 1
    fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

# --- Python package; the venv sees system packages so that nothing installed twice is downloaded twice
step "installing the Python package into .venv"
[ -x .venv/bin/python ] || python3 -m venv --system-site-packages .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,bench]'

# --- native library and llama.cpp with zipmoe: libraries and programs in build/bin
step "building libggml-zipmoe and llama.cpp with zipmoe into build/bin (first time: ~20 min on 2 cores)"
PYTHON=.venv/bin/python bash tools/dev/fetch_llama.sh  # pip of the venv: fresh systems have none
gen=(); [ -f build/CMakeCache.txt ] || { command -v ninja >/dev/null && gen=(-G Ninja); }
cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DZIPMOE_LLAMA=ON >/dev/null
cmake --build build -j "$(nproc)"

# --- llama-cpp-python, its Python part only (pyzipmoe.Llama, `zipmoe run -p` and the tests use it): it runs
# zipmoe's libllama from build/bin, where `import pyzipmoe` points it (LLAMA_CPP_LIB_PATH), so its own native
# build is switched off. Installed from the sha256-pinned sdist that tools/dev/fetch_llama.sh put in build/cache;
# skipped when that version is already installed.
LLAMA_CPP_PYTHON=0.3.36
if .venv/bin/python -c "import sys, importlib.metadata as m
sys.exit(m.version('llama_cpp_python') != '$LLAMA_CPP_PYTHON' or not m.version('diskcache'))" 2>/dev/null; then
    step "llama-cpp-python $LLAMA_CPP_PYTHON (Python part) is installed"
else
    step "installing llama-cpp-python $LLAMA_CPP_PYTHON (Python part, no native build) into .venv"
    pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
    # the sdist is built without isolation (an isolated build would fetch cmake and compile it from source):
    # the build backend comes from the venv, cmake (>= 3.21) and the C/C++ compilers from the system
    "${pip[@]}" 'scikit-build-core>=0.9.2'  # a no-op when the system's is recent enough
    cmake_ok=$(cmake --version 2>/dev/null | sed -n '1s/^cmake version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p' |
               awk '{ print ($1 > 3 || ($1 == 3 && $2 >= 21)) ? 1 : 0 }')
    [ "${cmake_ok:-0}" -eq 1 ] || "${pip[@]}" 'cmake>=3.21'
    # no wheel cache: a cached wheel of the same sdist may have been built with the native library
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" PATH="$PWD/.venv/bin:$PATH" "${pip[@]}" --no-cache-dir \
        --no-build-isolation "build/cache/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" \
        'diskcache>=5.6.1'
fi

# --- `import llama_cpp` in .venv runs zipmoe's libllama without importing pyzipmoe first: a .pth file whose finder
# points llama-cpp-python at build/bin when llama_cpp is first imported (pyzipmoe/llama_import.py)
step "making \`import llama_cpp\` in .venv run zipmoe's libllama"
.venv/bin/python -m pyzipmoe.llama_import

if [ "$run_demo" -eq 1 ]; then
    step "demo: a SYNTHETIC MoE under a memory budget of half its size, next to stock llama.cpp"
    .venv/bin/zipmoe demo
fi
step "done. Run the tests with:  .venv/bin/python -m pytest"
