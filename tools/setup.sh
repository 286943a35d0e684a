#!/usr/bin/env bash
# One command from a fresh clone to a working zipmoe: system packages, the native library, the
# Python package in .venv, then the demo (a synthetic MoE converted, verified and restored).
#   bash tools/setup.sh            everything, then the demo
#   bash tools/setup.sh --no-demo  everything but the demo
set -euo pipefail
cd "$(dirname "$0")/.."

run_demo=1
for arg in "$@"; do
    case "$arg" in
        --no-demo) run_demo=0 ;;
        -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown option $arg (try --help)" >&2; exit 2 ;;
    esac
done

step() { printf '\n==> %s\n' "$*"; }

# --- system packages (Debian/Ubuntu); skipped when already present
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v cc >/dev/null || need+=(build-essential)
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

# --- native library
step "building the native library (build/bin/libggml-zipmoe.so)"
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
[ -f build/CMakeCache.txt ] || cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)"

# --- Python package; the venv sees system packages so that nothing installed twice is downloaded twice
step "installing the Python package into .venv"
[ -x .venv/bin/python ] || python3 -m venv --system-site-packages .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'

if [ "$run_demo" -eq 1 ]; then
    step "demo: synthetic MoE -> zipmoe GGUF -> verify -> restore"
    .venv/bin/zipmoe demo
fi
step "done. Run the tests with:  .venv/bin/python -m pytest"
