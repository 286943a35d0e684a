"""The ARM64 build under emulation (tools/dev/cross_arm64.sh): libggml-zipmoe cross-compiled for aarch64 and its
self-test run by qemu-aarch64 on three CPUs (every NEON kernel against its portable oracle at every length and
alignment, every codec on every chunk shape, forged chunks refused), and the NEON kernels counted executing fewer
instructions per value than the portable ones (a qemu plugin's count: deterministic, not a timing).

Skipped where the cross toolchain, qemu-user or libzstd for arm64 are missing (`cross_arm64.sh --install` installs
them); under CI they must be there. The end-to-end check (llama.cpp cross-built, logits bit-identical under qemu)
takes a llama.cpp build: .ci/run runs it (`cross_arm64.sh build e2e`), and so does this file when
ZIPMOE_ARM64_E2E=1."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, unavailable

SCRIPT = REPO / "tools" / "dev" / "cross_arm64.sh"


def _build_dir() -> Path:
    return REPO / os.environ.get("ZIPMOE_ARM64_BUILD", "build-arm64")


@pytest.fixture(scope="module")
def cross_ready() -> None:
    missing = [t for t in ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++", "qemu-aarch64", "cmake")
               if shutil.which(t) is None]
    if not Path("/usr/lib/aarch64-linux-gnu/libzstd.so").exists():
        missing.append("libzstd-dev:arm64")
    if missing:
        unavailable(f"no ARM64 cross toolchain/emulator ({', '.join(missing)}): "
                    "`bash tools/dev/cross_arm64.sh --install` installs them")


def _script(*steps: str, timeout: float, **env_vars: str) -> str:
    env = {"PYTHON": sys.executable, **os.environ, "ZIPMOE_ARM64_BUILD": str(_build_dir()), **env_vars}
    out = subprocess.run(["bash", str(SCRIPT), *steps], env=env, capture_output=True, text=True, timeout=timeout,
                         check=False)
    assert out.returncode == 0, f"cross_arm64.sh {' '.join(steps)} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out.stdout


def test_selftest_passes_under_qemu_on_three_cpus(cross_ready: None) -> None:
    out = _script("build", "test", timeout=1800)
    results = re.findall(r"zipmoe-selftest: (\d+) checks, (\d+) failed", out)
    assert len(results) == 3, out[-3000:]  # default CPU, -cpu max, -cpu cortex-a53
    assert all(int(checks) > 100_000 and failed == "0" for checks, failed in results), results
    # the NEON kernels ran: split/merge dispatch reports level 2 on every emulated CPU
    assert out.count("simd level 2 (") == 3, out[-3000:]


def test_neon_kernels_execute_fewer_instructions_than_portable(cross_ready: None) -> None:
    if not (_build_dir() / "bin" / "zipmoe-selftest").exists():
        _script("build", timeout=1800)
    if shutil.which("cc") is None:
        unavailable("no host C compiler for the qemu plugin")
    out = _script("insn", timeout=900, INSN_ARGS="--no-results")
    rows = {m[1]: (float(m[2]), float(m[3])) for m in re.finditer(r"^(split|merge|checksum)\s+([\d.]+)\s+([\d.]+)", out,
                                                                  re.M)}
    assert set(rows) == {"split", "merge", "checksum"}, out
    for kernel, (portable, neon) in rows.items():
        assert 0 < neon < portable, (kernel, portable, neon)


@pytest.mark.skipif(os.environ.get("ZIPMOE_ARM64_E2E") != "1",
                    reason="cross-builds llama.cpp (long): ZIPMOE_ARM64_E2E=1 runs it; .ci/run runs the script")
def test_zipmoe_logits_bit_identical_to_bf16_under_qemu(cross_ready: None) -> None:
    out = _script("build", "e2e", timeout=5400)
    assert "bit-identical in every case" in out, out[-3000:]
    assert out.count("identical to the BF16 model's") == 12, out[-3000:]  # 4 runs x (logits, tokens, text)
