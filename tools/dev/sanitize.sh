#!/usr/bin/env bash
# Builds ggml-zipmoe with AddressSanitizer + UndefinedBehaviorSanitizer (build-asan, -DZIPMOE_SANITIZE=ON) and
# runs the codec, format, store and hardening tests and the fuzz regressions against it.
#
# The tests load the library into Python (cffi, dlopen), which is not built with the sanitizers: the ASan
# runtime has to be the first library of the process, so it is preloaded (LD_PRELOAD), and leak detection is
# off for Python itself (the harness programs that replay fuzz inputs check leaks). ZIPMOE_BUILD_DIR points
# pyzipmoe at build-asan. Any sanitizer report aborts the process, which fails the test run.
#   bash tools/dev/sanitize.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/../.."

BUILD=${ZIPMOE_ASAN_BUILD:-build-asan}
CC_ASAN=${CC:-cc}
gen=(); [ -f "$BUILD/CMakeCache.txt" ] || { command -v ninja >/dev/null && gen=(-G Ninja); }
cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER="$CC_ASAN" \
    -DZIPMOE_SANITIZE=ON >/dev/null
cmake --build "$BUILD"

libasan=$("$CC_ASAN" -print-file-name=libasan.so)
if [ ! -e "$libasan" ] || [ "$libasan" = libasan.so ]; then
    echo "sanitize.sh: $CC_ASAN has no libasan.so (Debian/Ubuntu: the compiler's libasan package)" >&2
    exit 1
fi
# the tests of the native code; those that need llama.cpp (not built here) are left out: their names say "llama"
ZIPMOE_BUILD_DIR="$BUILD" LD_PRELOAD="$libasan" \
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=1 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    .venv/bin/python -m pytest -q -p no:cacheprovider -k "not llama" \
    tests/native/test_codec.py tests/native/test_format.py tests/native/test_convert.py tests/native/test_store.py \
    tests/native/test_hardening.py tests/native/test_fuzz_regressions.py "$@"
