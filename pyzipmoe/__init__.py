"""zipmoe: lossless BF16 expert compression for Mixture-of-Experts models, run by a patched llama.cpp.

Importing this package is cheap: it loads neither the native library nor llama-cpp-python. It only points
llama-cpp-python at zipmoe's build of libllama (environment variable ``LLAMA_CPP_LIB_PATH``, unless it is
already set), so that once ``pyzipmoe`` has been imported, ``llama_cpp.Llama`` runs zipmoe GGUFs too.
``pyzipmoe.Llama`` is ``llama_cpp.Llama`` plus zipmoe's options (see ``pyzipmoe.runtime.llama``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

LLAMA_LIB_NAME = "libllama.so"
REPO_ROOT = Path(__file__).resolve().parent.parent


OPENMP_SPIN = ("GOMP_SPINCOUNT", "2000")
"""How long an OpenMP thread spins before it sleeps, for zipmoe's own process and the llama.cpp programs it starts.
ggml's threads meet at a barrier after every operation of the graph, and libgomp lets a waiting thread spin about
300000 rounds. With as many threads as cores (llama-cli's default), that spinning starved zipmoe's reader thread and
the kernel's reads: on 2 cores, llama-completion -t 2 generated 7.4-8.4 tokens/s at a 75% budget and 13.1 at 93%;
with 2000 rounds 13.1-13.7 and 23.3, and the same 62 tokens/s when everything fits. A value of the user's (or an
OMP_WAIT_POLICY) is kept; `bare llama-cli` needs it in its environment (README)."""


def openmp_environment(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """env (a dict, or os.environ) with OPENMP_SPIN added, unless it already says how OpenMP threads wait."""
    name, value = OPENMP_SPIN
    if name not in env and "OMP_WAIT_POLICY" not in env:
        env[name] = value
    return env


def build_dir() -> Path:
    """The CMake build directory: ``$ZIPMOE_BUILD_DIR``, else ``build/`` of the repository (as in ``_native``)."""
    return Path(os.environ.get("ZIPMOE_BUILD_DIR", REPO_ROOT / "build"))


def llama_lib_dir() -> Path | None:
    """The directory holding zipmoe's libllama.so (and its llama.cpp programs), or None if it was not built.

    Looked up in the same places as the native library: ``pyzipmoe/lib`` (an installed package), then
    ``<build dir>/bin``.
    """
    for d in (Path(__file__).resolve().parent / "lib", build_dir() / "bin"):
        if (d / LLAMA_LIB_NAME).is_file():
            return d
    return None


def _point_llama_cpp_at_our_build() -> None:
    """Set LLAMA_CPP_LIB_PATH for llama-cpp-python, which reads it once, when ``llama_cpp`` is first imported (and
    OPENMP_SPIN, which libgomp reads then).

    An existing value is kept, and nothing is set when zipmoe's libllama has not been built (a
    llama-cpp-python that bundles its own library then keeps working for plain GGUFs).
    """
    if "llama_cpp" in sys.modules:
        return
    openmp_environment(os.environ)  # libgomp reads it when llama_cpp loads libllama
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return
    found = llama_lib_dir()
    if found is not None:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(found)


_point_llama_cpp_at_our_build()


def __getattr__(name: str) -> Any:
    if name == "Llama":  # imports llama_cpp (and opens libllama) only when asked for
        from .runtime.llama import Llama

        return Llama
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
