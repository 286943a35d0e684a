"""zipmoe-selftest (ggml_zipmoe/tests/simd_selftest.c) built for this machine and run: every SIMD kernel this CPU has
(AVX2 split/merge and XXH3, the AVX-512 VBMI2 escape decoder; NEON on ARM64) against its portable oracle at every
length and alignment, every codec on every chunk shape, forged chunks refused. It calls the library's internal
functions, so it is a static build of its own, in $ZIPMOE_SELFTEST_BUILD (default build-selftest; reused)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from helpers import REPO, unavailable


def test_selftest_passes_on_this_machine() -> None:
    if shutil.which("cmake") is None or shutil.which("cc") is None:
        unavailable("cmake and a C compiler are needed to build zipmoe-selftest")
    build = REPO / os.environ.get("ZIPMOE_SELFTEST_BUILD", "build-selftest")
    gen = [] if (build / "CMakeCache.txt").exists() or shutil.which("ninja") is None else ["-G", "Ninja"]
    for cmd in (["cmake", "-S", str(REPO), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release", "-DZIPMOE_SELFTEST=ON"],
                ["cmake", "--build", str(build), "--target", "zipmoe-selftest", "-j", str(os.cpu_count() or 1)]):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        assert out.returncode == 0, f"{' '.join(cmd)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    run = subprocess.run([str(build / "bin" / "zipmoe-selftest")], capture_output=True, text=True, timeout=600,
                         check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    checks, failed = map(int, re.search(r"(\d+) checks, (\d+) failed", run.stdout).groups())
    assert checks > 100_000 and failed == 0, run.stdout
