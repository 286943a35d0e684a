#!/usr/bin/env bash
# Fuzzes zipmoe's native parsers and decoders with libFuzzer (+ AddressSanitizer, UndefinedBehaviorSanitizer):
#   fuzz_chunk: the huff and zstd chunk decoders, checksum check off and forged;
#   fuzz_index: the expert index parser and expert decoding, index and chunk checksums forged.
# Seeds are generated from the test models (tools/dev/make_corpus.py) into build-fuzz/corpus; the
# corpus grows there between runs. Any crash is saved in build-fuzz/artifacts and fails the run: copy it into
# tests/fuzz_regressions/<target>/ (tests/native/test_fuzz_regressions.py replays that directory in every build).
#
#   bash tools/dev/fuzz.sh [SECONDS_PER_TARGET]     default 30; CI runs 25 per target
#   bash tools/dev/fuzz.sh 3600                     a longer campaign (an hour per target)
#   JOBS=2 bash tools/dev/fuzz.sh 600               libFuzzer workers per target
#
# Needs clang and libFuzzer (Debian/Ubuntu: apt-get install clang libclang-rt-dev, or clang-14
# libclang-rt-14-dev), cmake, ninja, and the Python package in .venv (for the seeds).
set -euo pipefail
cd "$(dirname "$0")/../.."

SECONDS_PER_TARGET=${1:-30}
JOBS=${JOBS:-1}
BUILD=${ZIPMOE_FUZZ_BUILD:-build-fuzz}
PYTHON=${PYTHON:-.venv/bin/python}
CC_FUZZ=${CC_FUZZ:-$(command -v clang || command -v clang-14 || command -v clang-15 || command -v clang-16 || true)}
if [ -z "$CC_FUZZ" ]; then
    echo "fuzz.sh: clang not found (apt-get install clang-14 libclang-rt-14-dev)" >&2
    exit 1
fi

gen=(); [ -f "$BUILD/CMakeCache.txt" ] || { command -v ninja >/dev/null && gen=(-G Ninja); }
cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER="$CC_FUZZ" \
    -DZIPMOE_FUZZ=ON >/dev/null
cmake --build "$BUILD" --target zipmoe-libfuzzer-chunk zipmoe-libfuzzer-index

if [ ! -d "$BUILD/corpus/chunk" ] || [ ! -d "$BUILD/corpus/index" ]; then
    "$PYTHON" tools/dev/make_corpus.py "$BUILD/corpus"
fi
mkdir -p "$BUILD/artifacts"

status=0
for target in chunk index; do
    echo "==> fuzz_$target for ${SECONDS_PER_TARGET}s"
    # the regression inputs first: a fixed bug must stay fixed
    if [ -d "tests/fuzz_regressions/$target" ]; then
        "$BUILD/bin/zipmoe-libfuzzer-$target" -runs=0 "tests/fuzz_regressions/$target" >/dev/null 2>&1 || {
            echo "fuzz.sh: a regression input of fuzz_$target fails again" >&2; status=1; }
    fi
    log="$BUILD/fuzz-$target.log"
    parallel=(); [ "$JOBS" -gt 1 ] && parallel=(-jobs="$JOBS" -workers="$JOBS")
    if ! (cd "$BUILD" && "bin/zipmoe-libfuzzer-$target" -max_total_time="$SECONDS_PER_TARGET" -max_len=70000 \
            -timeout=10 -rss_limit_mb=2048 "${parallel[@]}" -print_final_stats=1 \
            -artifact_prefix="artifacts/$target-" "corpus/$target") >"$log" 2>&1; then
        echo "fuzz.sh: fuzz_$target found a crash; the input is in $BUILD/artifacts, the report in $log:" >&2
        grep -E "ERROR|runtime error|SUMMARY" "$log" | head -5 >&2 || true
        status=1
    fi
    grep -E "^Done|stat::number_of_executed_units|stat::new_units_added" "$log" | tr '\n' ' ' || true
    echo
done
exit $status
