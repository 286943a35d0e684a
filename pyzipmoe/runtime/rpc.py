"""ggml-rpc-server endpoints as devices of this process's ggml (what llama.cpp's --rpc does; docs/rpc.md)."""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Sequence

from ..errors import UnsupportedError
from .libllama import ZipmoeLoadError, loaded_library

RPC_CONNECT_TIMEOUT = 10.0  # seconds for an endpoint to accept a connection before it counts as not answering
_rpc_added: set[str] = set()


def rpc_endpoints(servers: str | Sequence[str]) -> list[str]:
    """ "host:port,host:port" (or a list of such) as a list of endpoints; a malformed one raises ZipmoeLoadError."""
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    endpoints = [e.strip() for e in items if e.strip()]
    if not endpoints:
        raise ZipmoeLoadError("rpc_servers names no server (host:port,...)")
    for e in endpoints:
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ZipmoeLoadError(f"RPC server {e!r} is not host:port")
    return endpoints


def add_rpc_servers(servers: str | Sequence[str]) -> list[str]:
    """Adds the devices of ggml-rpc-server endpoints to this process's ggml (what llama.cpp's --rpc does), once
    per endpoint; each must accept a connection first (ggml-rpc ends the process when it cannot connect)."""
    endpoints = rpc_endpoints(servers)
    for e in endpoints:
        host, _, port = e.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=RPC_CONNECT_TIMEOUT).close()
        except OSError as err:
            raise ZipmoeLoadError(f"cannot connect to the RPC server {e} ({err.strerror or err}); start "
                                  "ggml-rpc-server there (docs/rpc.md)") from None
    ggml = ctypes.CDLL(str(loaded_library().parent / "libggml.so"))
    ggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    reg = ggml.ggml_backend_reg_by_name(b"RPC")
    add = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
    if not add:
        raise UnsupportedError(f"the libllama in use ({loaded_library()}) was built without the RPC backend; "
                               "build it with `bash tools/setup.sh`")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(add)
    for e in endpoints:
        if e not in _rpc_added:
            ggml.ggml_backend_register(add_server(e.encode()))
            _rpc_added.add(e)
    return endpoints
