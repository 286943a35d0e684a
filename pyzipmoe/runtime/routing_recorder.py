"""The routing of a run as it goes: which experts each MoE block chose at every step, read from the runtime's log
(Llama(record_routing=True); a recorded-routing file, docs/FORMAT.md)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ZipmoeError


class RoutingRecorder:
    """Collects the runtime's routing log (zipmoe_cache_routing) of every MoE block after each decode: the log keeps
    the last 512 invocations of a store, one per ubatch (a graph computed), so each decode's entries are read before
    the next can push them out. How many a block logged comes from its activation counters (rows routed): llama.cpp
    computes the last block only for the rows whose logits are wanted (a prompt's last token), so a prompt's other
    ubatches route nothing there, and their steps record no expert in that block."""

    def __init__(self, model_path: str, n_ubatch: int) -> None:
        from ..plan.inputs import geometry_from_gguf

        g = geometry_from_gguf(model_path)
        self.layers, self.n_expert, self.k = g.layers, g.n_expert, g.n_expert_used
        self.n_ubatch = max(1, int(n_ubatch))
        self.words = (self.n_expert + 63) // 64
        self.steps: list[np.ndarray] = []  # bool [n_layer, n_expert] each
        self.tokens: list[int] = []
        self.rows = [self._activations(layer).sum() for layer in self.layers]

    def _activations(self, layer: int) -> np.ndarray:
        from .._native import ffi, lib

        buf = np.zeros(self.n_expert, np.uint64)
        lib.zipmoe_cache_activations(f"blk.{layer}.".encode(), ffi.cast("uint64_t *", ffi.from_buffer(buf)),
                                     self.n_expert)
        return buf

    def note_decode(self, n_tokens: int) -> None:
        from .._native import ffi, lib

        sizes = [min(self.n_ubatch, n_tokens - i) for i in range(0, n_tokens, self.n_ubatch)]
        if not sizes:
            return
        n = len(sizes)
        masks = np.zeros(n * self.words, np.uint64)
        step = np.zeros((n, len(self.layers), self.n_expert), bool)
        for i, layer in enumerate(self.layers):
            total = int(self._activations(layer).sum())
            rows, self.rows[i] = (total - int(self.rows[i])) // self.k, total
            # the ubatches holding the decode's last `rows` tokens (all of them, or those whose logits are wanted)
            first = n_tokens - min(rows, n_tokens)
            logged = n - first // self.n_ubatch if rows else 0
            if logged == 0:
                continue
            got = lib.zipmoe_cache_routing(f"blk.{layer}.".encode(), ffi.cast("uint64_t *", ffi.from_buffer(masks)),
                                           self.words, logged)
            if got != logged:
                raise ZipmoeError(f"routing recorder: block {layer} logged {got} step(s) of a decode of {n_tokens} "
                                  f"token(s) ({logged} expected)")
            bits = np.unpackbits(masks[: logged * self.words].view(np.uint8), bitorder="little")
            step[n - logged:, i] = bits.reshape(logged, self.words * 64)[:, : self.n_expert].astype(bool)
        self.steps.extend(step)
        self.tokens.extend(sizes)

    def routing(self) -> Any:
        from ..plan import trace

        routed = np.stack(self.steps) if self.steps else np.zeros((0, len(self.layers), self.n_expert), bool)
        return trace.Routing(routed=routed, layers=np.asarray(self.layers, np.int32),
                             tokens=np.asarray(self.tokens, np.int32), k=self.k)
