"""zipmoe: lossless BF16 expert compression for Mixture-of-Experts models, run by a patched llama.cpp.

Importing this package is cheap: it loads neither the native library nor llama-cpp-python. It only points
llama-cpp-python at zipmoe's build of libllama (environment variable ``LLAMA_CPP_LIB_PATH``, unless it is
already set), so that once ``pyzipmoe`` has been imported, ``llama_cpp.Llama`` runs zipmoe GGUFs too.
``pyzipmoe.Llama`` is ``llama_cpp.Llama`` plus zipmoe's options (see ``pyzipmoe.llama``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

LLAMA_LIB_NAME = "libllama.so"
REPO_ROOT = Path(__file__).resolve().parent.parent


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
    """Set LLAMA_CPP_LIB_PATH for llama-cpp-python, which reads it once, when ``llama_cpp`` is first imported.

    An existing value is kept, and nothing is set when zipmoe's libllama has not been built (a
    llama-cpp-python that bundles its own library then keeps working for plain GGUFs).
    """
    if os.environ.get("LLAMA_CPP_LIB_PATH") or "llama_cpp" in sys.modules:
        return
    found = llama_lib_dir()
    if found is not None:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(found)


_point_llama_cpp_at_our_build()


def __getattr__(name: str) -> Any:
    if name == "Llama":  # imports llama_cpp (and opens libllama) only when asked for
        from .llama import Llama

        return Llama
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
