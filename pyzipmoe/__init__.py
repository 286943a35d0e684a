"""zipmoe: lossless BF16 expert compression for Mixture-of-Experts models, run by a patched llama.cpp.

Subpackages: ``file`` (GGUF and zipmoe files: read, convert, verify), ``runtime`` (``Llama``, the llama.cpp
programs, budgets, the runtime's configuration), ``plan`` (the tier planner and its calibration), ``models``
(Ollama-style model packages) and ``cli`` (the ``zipmoe`` command).

Importing this package is cheap: it loads no llama-cpp-python, and the native library only to read OpenMP's
spinning from it. It has one effect, on purpose: it calls ``use_zipmoe_llama()``, which points llama-cpp-python at
zipmoe's build of libllama (it sets ``LLAMA_CPP_LIB_PATH`` unless it is already set, and OpenMP's
``GOMP_SPINCOUNT`` unless how OpenMP threads wait is already set; nothing once ``llama_cpp`` has been imported), so
that once ``pyzipmoe`` has been imported, ``llama_cpp.Llama`` runs zipmoe GGUFs too (in the venv tools/setup.sh
makes, ``import llama_cpp`` alone does the same: ``pyzipmoe.llama_import``). ``pyzipmoe.Llama`` is ``llama_cpp.Llama`` plus zipmoe's options (see
``pyzipmoe.runtime.llama``); it is imported when first asked for.
"""

from __future__ import annotations

from typing import Any

from .paths import build_dir, llama_lib_dir
from .runtime.config import openmp_environment, use_zipmoe_llama

__all__ = ["Llama", "OPENMP_SPIN", "build_dir", "llama_lib_dir", "openmp_environment", "use_zipmoe_llama"]

use_zipmoe_llama()


def __getattr__(name: str) -> Any:
    if name == "Llama":  # imports llama_cpp (and opens libllama) only when asked for
        from .runtime.llama import Llama

        return Llama
    if name == "OPENMP_SPIN":  # (read from the native library)
        from .runtime.config import openmp_spin

        return openmp_spin()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
