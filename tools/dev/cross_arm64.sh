#!/usr/bin/env bash
# AArch64 under emulation: cross-compiles libggml-zipmoe, its SIMD self-test and (for e2e) the patched llama.cpp for
# aarch64 Linux (tools/dev/aarch64.cmake), and runs them with qemu-user. Speed cannot be measured this way; what is
# checked is that the ARM64 build is correct: the NEON kernels against their portable oracles, and a zipmoe GGUF's
# logits bit-identical to its BF16 source's, both run on the emulated ARM64 (ggml's ARM kernels sum in another order
# than its x86 ones, so ARM is compared to ARM).
#   bash tools/dev/cross_arm64.sh [--install] [STEP...]   steps: build test e2e insn (default: build test e2e)
#     build  configure and build in $ZIPMOE_ARM64_BUILD (default build-arm64; reused: a second run rebuilds what
#            changed); e2e also builds llama.cpp's llama-simple, llama-cli and zipmoe-logits there
#     test   zipmoe-selftest under qemu-aarch64: the default CPU (NEON), -cpu max (every optional extension) and
#            -cpu cortex-a53 (a small in-order core: ARMv8.0, NEON only)
#     e2e    a tiny synthetic BF16 MoE (SYNTHETIC weights), converted on the host (huff and esc), run by the ARM64
#            build: logits of the prompt and of greedy tokens bit-identical to the BF16 model's, with no budget and
#            a tiny one (ZIPMOE_MEMORY_BUDGET); llama-simple's text identical too
#     insn   guest instructions per value of each kernel, NEON against portable, counted by a qemu plugin
#            (tools/dev/qemu_insn_count.c); tools/bench/arm64_insn.py prints the table and writes it to bench/results
#            (INSN_ARGS="--no-results" writes nothing)
#   --install  apt-get the cross toolchain, qemu-user, ccache (a rebuild in a fresh build directory, CI) and
#              libzstd-dev:arm64 (adds the arm64 architecture to dpkg);
#              alone, it installs and runs no step
# The host's Python (.venv, or $PYTHON) and a host build of libggml-zipmoe ($ZIPMOE_BUILD_DIR, default build) make
# and convert the model for e2e.
set -euo pipefail
cd "$(dirname "$0")/../.."

BUILD=${ZIPMOE_ARM64_BUILD:-build-arm64}
PYTHON=${PYTHON:-.venv/bin/python}
SYSROOT=/usr/aarch64-linux-gnu
JOBS=${JOBS:-$(nproc)}

steps=()
install=0
for arg in "$@"; do
    case "$arg" in
        --install) install=1 ;;
        build|test|e2e|insn) steps+=("$arg") ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "cross_arm64.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
    esac
done
if [ ${#steps[@]} -eq 0 ]; then
    [ "$install" -eq 1 ] && steps=(none) || steps=(build test e2e)  # --install alone installs only
fi
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
step() { printf '\n==> arm64: %s\n' "$*"; }

if [ "$install" -eq 1 ]; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null ||
       ! dpkg -s libzstd-dev:arm64 >/dev/null 2>&1; then
        step "installing the cross toolchain, qemu-user and libzstd-dev:arm64"
        $sudo dpkg --add-architecture arm64
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq crossbuild-essential-arm64 qemu-user ccache \
            libzstd-dev:arm64 >/dev/null
    fi
fi
for tool in aarch64-linux-gnu-gcc aarch64-linux-gnu-g++ qemu-aarch64; do
    if ! command -v "$tool" >/dev/null; then
        echo "cross_arm64.sh: $tool not found: run with --install, or apt-get install crossbuild-essential-arm64 qemu-user" >&2
        exit 1
    fi
done
if [ ! -e /usr/lib/aarch64-linux-gnu/libzstd.so ]; then
    echo "cross_arm64.sh: no libzstd for arm64: run with --install (dpkg --add-architecture arm64; libzstd-dev:arm64)" >&2
    exit 1
fi

# qemu-user finds the target's files under the sysroot first, then on the host's own paths. The loader comes from
# the cross sysroot; so must libc, which the loader would otherwise take from the host's ld.so.cache, where
# libzstd-dev:arm64 brought a multiarch libc6:arm64 of another build (a mismatched pair hangs in pthread_create):
# LD_LIBRARY_PATH puts the sysroot's /lib first, then the multiarch directory for libzstd.
QEMU=(qemu-aarch64 -L "$SYSROOT" -E LD_LIBRARY_PATH=/lib:/usr/lib/aarch64-linux-gnu)
qemu() { "${QEMU[@]}" "$@"; }

llama=0
if want e2e; then llama=1; fi
if want build; then
    step "configuring and building $BUILD (llama.cpp: $([ $llama -eq 1 ] && echo yes || echo no))"
    cfg=(-DCMAKE_BUILD_TYPE=Release -DZIPMOE_SELFTEST=ON)
    [ -f "$BUILD/CMakeCache.txt" ] || cfg+=(-DCMAKE_TOOLCHAIN_FILE=tools/dev/aarch64.cmake)  # (read at the first only)
    if [ $llama -eq 1 ] || grep -q '^ZIPMOE_LLAMA:BOOL=ON' "$BUILD/CMakeCache.txt" 2>/dev/null; then
        PYTHON="$PYTHON" bash tools/dev/fetch_llama.sh  # (re-made only when a patch changed)
    fi
    if [ $llama -eq 1 ]; then
        # GGML_NATIVE=OFF: ggml's ARM kernels for the base architecture, so the binary runs on any ARMv8 core
        cfg+=(-DZIPMOE_LLAMA=ON -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF)
    fi
    if command -v ccache >/dev/null; then
        cfg+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    fi
    gen=(); [ -f "$BUILD/CMakeCache.txt" ] || { command -v ninja >/dev/null && gen=(-G Ninja); }
    cmake -S . -B "$BUILD" "${gen[@]}" "${cfg[@]}" >/dev/null
    targets=(ggml-zipmoe zipmoe-selftest)
    [ $llama -eq 1 ] && targets+=(llama-simple llama-cli zipmoe-logits)
    cmake --build "$BUILD" -j "$JOBS" --target "${targets[@]}"
fi

if want test; then
    for cpu in "" max cortex-a53; do
        step "zipmoe-selftest under qemu-aarch64${cpu:+ -cpu $cpu}"
        qemu ${cpu:+-cpu "$cpu"} "$BUILD/bin/zipmoe-selftest"
    done
fi

if want e2e; then
    for prog in llama-simple llama-cli zipmoe-logits; do
        if [ ! -x "$BUILD/bin/$prog" ]; then
            echo "cross_arm64.sh: $BUILD/bin/$prog is missing: run the build step with e2e (cross_arm64.sh build e2e)" >&2
            exit 1
        fi
    done
    work=$(mktemp -d "${TMPDIR:-/tmp}/zipmoe-arm64.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    step "a tiny SYNTHETIC MoE, converted on the host (huff, esc)"
    export ZIPMOE_BUILD_DIR=${ZIPMOE_BUILD_DIR:-$PWD/build}
    "$PYTHON" tools/dev/make_synth.py --preset tiny --quiet "$work/bf16.gguf"
    budget=$(PYTHONPATH=$PWD "$PYTHON" - "$work" <<'EOF'
import sys
from pathlib import Path
from pyzipmoe.file.convert import convert
from pyzipmoe.runtime.budget import model_memory
work = Path(sys.argv[1])
for codec in ("huff", "esc"):  # small chunks: several per expert, so every chunk shape is decoded
    convert(work / "bf16.gguf", work / f"{codec}.gguf", codec=codec, chunk_n=1000, threads=2)
need = model_memory(work / "huff.gguf")
print(need.minimum + need.expert_bytes // 8)  # about an eighth of the experts: the tiers evict all the time
EOF
)
    prompt="the expert of the synthetic model"
    run() { # NAME MODEL [VAR=VALUE...]: logits and greedy tokens of MODEL under qemu
        local name=$1 model=$2; shift 2
        env "$@" "${QEMU[@]}" "$BUILD/bin/zipmoe-logits" "$work/$model.gguf" "$prompt" 12 2 "$work/$name.f32" \
            >"$work/$name.tokens"
        env "$@" "${QEMU[@]}" "$BUILD/bin/llama-simple" -m "$work/$model.gguf" -n 12 "$prompt" 2>"$work/$name.err" \
            >"$work/$name.txt" || { tail -20 "$work/$name.err" >&2; return 1; }
    }
    step "llama-cli under qemu-aarch64 (it starts and knows the zipmoe flags)"
    cli_help=$("${QEMU[@]}" "$BUILD/bin/llama-cli" --help 2>&1 || true)
    case $cli_help in
        *--memory-budget*) echo "  llama-cli --help: runs, lists --memory-budget" ;;
        *) echo "cross_arm64.sh: the cross-built llama-cli does not run, or lacks --memory-budget" >&2; exit 1 ;;
    esac
    step "BF16 model under qemu-aarch64"
    run ref bf16
    ref_size=$(stat -c %s "$work/ref.f32")
    [ "$ref_size" -gt 0 ] || { echo "cross_arm64.sh: the BF16 run wrote no logits" >&2; exit 1; }
    if cmp -s <(head -c 4096 "$work/ref.f32") <(head -c 4096 /dev/zero); then
        echo "cross_arm64.sh: the BF16 run's logits are all zero" >&2; exit 1
    fi
    fail=0
    for case in "huff none" "huff tiny" "esc none" "esc tiny"; do
        set -- $case
        vars=(); [ "$2" = tiny ] && vars=(ZIPMOE_MEMORY_BUDGET="$budget")
        step "zipmoe GGUF ($1 codec, budget: $2${vars:+ = $budget bytes}) under qemu-aarch64"
        run "$1-$2" "$1" "${vars[@]}"
        for what in f32 tokens txt; do
            if cmp -s "$work/ref.$what" "$work/$1-$2.$what"; then
                echo "  $what: identical to the BF16 model's ($(stat -c %s "$work/ref.$what") bytes)"
            else
                echo "  $what: DIFFERENT from the BF16 model's" >&2
                fail=1
            fi
        done
    done
    [ $fail -eq 0 ] || { echo "cross_arm64.sh: e2e: a zipmoe run differs from its BF16 source" >&2; exit 1; }
    echo "e2e: logits ($((ref_size / 4)) floats), greedy tokens and text bit-identical in every case"
fi

if want insn; then
    step "guest instructions per value, by kernel (qemu plugin: NEON against portable; tools/bench/arm64_insn.py)"
    plugin="$BUILD/libqemu_insn_count.so"
    cc -O2 -shared -fPIC -o "$plugin" tools/dev/qemu_insn_count.c
    # INSN_ARGS: more arguments for arm64_insn.py (--novec-build DIR, --no-results, --label WORD)
    # shellcheck disable=SC2086
    "$PYTHON" tools/bench/arm64_insn.py --build "$BUILD" --plugin "$plugin" ${INSN_ARGS:-}
fi
