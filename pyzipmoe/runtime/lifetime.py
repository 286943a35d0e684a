"""The lifetime of the llama.cpp programs zipmoe starts (runner.run_foreground: llama-cli for `zipmoe run`,
llama-server for `zipmoe serve`): they die with the zipmoe process that started them, whatever kills it."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn for a program this process starts and waits for: the kernel kills the program (SIGKILL) when
    this process dies, even by SIGKILL, so that no llama-server keeps serving unsupervised, its budget no longer
    followed (Linux's PR_SET_PDEATHSIG; it lasts across the program's exec of itself). The signal comes when the
    thread that started the program ends, so the caller starts it in the thread that waits for it. None where
    prctl is not there."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0 and os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)  # the parent died before the call: too late for the signal

    return preexec
