#!/usr/bin/env bash
# Builds stock llama.cpp: the pinned sdist that zipmoe's build patches (tools/dev/fetch_llama.sh), without the
# patches, with llama.cpp's own CMake defaults and the options zipmoe's CMakeLists.txt sets for its copy. "Stock"
# in zipmoe's tests and claims means this build: the stock comparisons in tests/engine/test_llama.py find it at
# build/llama-stock/bin (or ZIPMOE_STOCK_LLAMA_BIN).
#   bash tools/dev/build_stock.sh [TARGET ...]     default targets: llama llama-simple llama-bench llama-completion
set -euo pipefail
cd "$(dirname "$0")/../.."

SRC=build/llama-stock-src
OUT=build/llama-stock
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(llama llama-simple llama-bench llama-completion)

bash tools/dev/fetch_llama.sh --stock "$SRC"
launcher=()
if command -v ccache >/dev/null; then
    launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
generator=()
if [ ! -f "$OUT/CMakeCache.txt" ] && command -v ninja >/dev/null; then
    generator=(-G Ninja)
fi
cmake -S "$SRC" -B "$OUT" "${generator[@]}" "${launcher[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >/dev/null
cmake --build "$OUT" -j"$(nproc)" --target "${targets[@]}"
echo "stock llama.cpp: $OUT/bin"
