"""`import llama_cpp` on zipmoe's libllama, without importing pyzipmoe first, in the venv that tools/setup.sh makes.

llama-cpp-python opens its native library when ``llama_cpp`` is first imported: from ``$LLAMA_CPP_LIB_PATH``, else
from its own ``llama_cpp/lib``, which zipmoe's setup leaves empty (it installs llama-cpp-python's Python part only,
to run zipmoe's libllama from build/bin). ``import pyzipmoe`` sets the variable
(pyzipmoe.runtime.config.use_zipmoe_llama); this file makes ``import llama_cpp`` do the same.

tools/setup.sh writes ``zipmoe-llama.pth`` (PTH_NAME) into the venv's site-packages (``python -m
pyzipmoe.llama_import``). Its one line loads this file at interpreter start, by its path and alone: neither the
pyzipmoe package nor anything else is imported, and no variable is set. It installs a finder that does nothing until
``llama_cpp`` is first imported; then it imports pyzipmoe, which points llama-cpp-python at build/bin as ``import
pyzipmoe`` always does (a ``LLAMA_CPP_LIB_PATH`` already set is kept). Where llama-cpp-python would find no library
(zipmoe's llama.cpp not built, and none in ``LLAMA_CPP_LIB_PATH`` or ``llama_cpp/lib``), the import fails with an
ImportError whose one line says what to do, instead of llama-cpp-python's FileNotFoundError.
"""

from __future__ import annotations

import os
import sys

PTH_NAME = "zipmoe-llama.pth"
MODULE_NAME = "_zipmoe_llama_import"  # this file's name when the .pth loads it
LIB_NAME = "libllama.so"


class LlamaFinder:
    """A meta path finder that only watches for the first import of llama_cpp; it finds nothing itself."""

    zipmoe_llama = True  # (how install() recognises one, whichever copy of this file made it)

    def __init__(self) -> None:
        self.done = False

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "llama_cpp" and not self.done:
            self.done = True
            prepare()
        return None


def prepare() -> None:
    """What `import pyzipmoe` does for llama-cpp-python; ImportError with one line when no libllama would load."""
    try:
        import pyzipmoe  # noqa: F401 - use_zipmoe_llama(): LLAMA_CPP_LIB_PATH, unless set
    except ImportError:
        return  # (pyzipmoe uninstalled: llama-cpp-python on its own)
    where = os.environ.get("LLAMA_CPP_LIB_PATH")
    if where:
        if not os.path.isfile(os.path.join(where, LIB_NAME)):
            raise ImportError(f"zipmoe: LLAMA_CPP_LIB_PATH={where} holds no {LIB_NAME}; point it at zipmoe's "
                              f"build ({_bin_dir()}) or unset it")
        return
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return  # (not installed: Python says so)
    if os.path.isfile(os.path.join(list(spec.submodule_search_locations)[0], "lib", LIB_NAME)):
        return  # a llama-cpp-python with its own library
    raise ImportError(f"zipmoe: llama_cpp here runs zipmoe's libllama, and {_bin_dir()}/{LIB_NAME} is not built: "
                      "run `bash tools/setup.sh` (or set ZIPMOE_BUILD_DIR, or LLAMA_CPP_LIB_PATH, to where it is)")


def _bin_dir() -> str:
    from pyzipmoe.paths import bin_dir

    return str(bin_dir())


def install() -> None:
    """Puts the finder first on sys.meta_path, once."""
    if not any(getattr(f, "zipmoe_llama", False) for f in sys.meta_path):
        sys.meta_path.insert(0, LlamaFinder())  # type: ignore[arg-type]


def pth_line(path: str | None = None) -> str:
    """The .pth file's line: loads this file (if it is still there) and installs the finder."""
    path = os.path.abspath(path or __file__)
    return (f"import os, importlib.util as u; p = {path!r}; s = os.path.isfile(p) and "
            f"u.spec_from_file_location({MODULE_NAME!r}, p); m = s and u.module_from_spec(s); "
            "s and (s.loader.exec_module(m) or m.install())\n")


def write_pth(site_dir: str | os.PathLike[str]) -> str:
    """Writes PTH_NAME into `site_dir`; its path."""
    target = os.path.join(os.fspath(site_dir), PTH_NAME)
    with open(target, "w") as f:
        f.write(pth_line())
    return target


def main(argv: list[str]) -> int:
    import sysconfig

    site_dir = argv[0] if argv else sysconfig.get_paths()["purelib"]
    print(f"wrote {write_pth(site_dir)}: `import llama_cpp` runs zipmoe's libllama in this environment")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
