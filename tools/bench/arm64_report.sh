#!/usr/bin/env bash
# The speed tables of an ARM64 board (Raspberry Pi 5, Jetson, Graviton/Ampere, an ARM laptop): what CI cannot
# measure, since it runs ARM64 only under emulation. Run on the board itself, after `bash tools/setup.sh`:
#   bash tools/bench/arm64_report.sh            bench_codec (synthetic and trained-weight exponents) and
#                                               bench_budget (llama.cpp stock vs zipmoe under budgets, 1g preset)
#   bash tools/bench/arm64_report.sh --quick    short runs (a few minutes), for a first look
# It checks first that the build is native ARM64 and correct (zipmoe-selftest: the NEON kernels against their
# portable oracles), then writes the tables as dated files in bench/results/ (tools/bench/results.py), labelled
# arm64 (the CPU's name and features are printed first). bench_budget needs root (sudo) and the cgroup v1 memory
# controller. Models are SYNTHETIC (pyzipmoe.synth); speeds are ratios against stock llama.cpp in the same run.
# Send the two files (or a pull request) to have them in the README.
set -euo pipefail
cd "$(dirname "$0")/../.."

quick=0
for arg in "$@"; do
    case "$arg" in
        --quick) quick=1 ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) echo "arm64_report.sh: unknown option $arg (try --help)" >&2; exit 2 ;;
    esac
done

arch=$(uname -m)
if [ "$arch" != aarch64 ] && [ "$arch" != arm64 ]; then
    echo "arm64_report.sh: this is $arch: run me on an ARM64 board (CI checks ARM64 under qemu: tools/dev/cross_arm64.sh)" >&2
    exit 1
fi
[ -x .venv/bin/python ] && [ -e build/bin/libggml-zipmoe.so ] || {
    echo "arm64_report.sh: run bash tools/setup.sh first" >&2; exit 1; }

printf '==> CPU: %s; features: %s\n' "$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)" \
    "$(grep -m1 '^Features' /proc/cpuinfo | cut -d: -f2- | xargs)"

echo "==> zipmoe-selftest (NEON kernels against their portable oracles)"
cmake -S . -B build -DZIPMOE_SELFTEST=ON >/dev/null
cmake --build build --target zipmoe-selftest -j "$(nproc)" >/dev/null
build/bin/zipmoe-selftest

if [ "$quick" -eq 1 ]; then
    codec_args=(--quick)
    budget_args=(--preset small --overhead 16MiB --gen 16 --pp 64 --budgets 60,100 --routings skewed)
else
    codec_args=() budget_args=(--preset 1g)
fi
echo "==> bench_codec (decode speed of huff, esc and zstd on this CPU)"
.venv/bin/python tools/bench/bench_codec.py --threads "$(nproc)" --label arm64 "${codec_args[@]}"

# bench_budget runs each model in a cgroup memory limit: root and the cgroup v1 memory controller
echo "==> bench_budget (tokens/s against stock llama.cpp under memory budgets)"
if [ ! -d /sys/fs/cgroup/memory ]; then
    echo "arm64_report.sh: no cgroup v1 memory controller (/sys/fs/cgroup/memory): bench_budget skipped" >&2
    echo "  (boot with systemd.unified_cgroup_hierarchy=0, or run it where v1 is mounted)" >&2
    exit 1
fi
sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo .venv/bin/python tools/bench/bench_budget.py --threads "$(nproc)" --label arm64 "${budget_args[@]}"
echo "==> done: the tables are in bench/results/*-arm64.md"
