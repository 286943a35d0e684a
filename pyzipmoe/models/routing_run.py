"""A stored model's routing recorded by running a short built-in prompt set through it (`zipmoe calibrate NAME`
without --routing): the counts become its kept prior (pyzipmoe.plan.prior, docs/cache-and-planner.md "Priors
across prompts").

Greedy, PROMPT_TOKENS tokens a prompt at most, through pyzipmoe.Llama(record_routing=True) without a memory budget
(every expert routed is counted; no run record of its own is left), in the model's chat template where it has one
(the package's TEMPLATE or the GGUF's), else as plain completions, which the caller is told.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..progress import Progress
    from .directory import ModelDirectory

# A few kinds of text a model is asked for (chat, code, arithmetic, translation, summary, lists, explanation,
# creative), so that the experts they route to are a model's everyday ones rather than one topic's.
PROMPTS = (
    "Hello! Can you tell me a little about yourself?",
    "Write a Python function that returns the n-th Fibonacci number, with a short docstring.",
    "What is 17 times 23? Show your working step by step.",
    "Translate into French and German: The weather is nice today, let us go for a walk.",
    "Summarize in two sentences why the sky is blue.",
    "List five vegetables that grow well in a cold climate.",
    "Explain what a hash table is to a beginner programmer.",
    "Write a short poem about the sea at night.",
)
PROMPT_TOKENS = 48  # generated a prompt at most: 8 x 48, a few hundred tokens, plus the prompts'


@dataclass(frozen=True)
class RecordedRouting:
    counts: np.ndarray  # (n_layer, n_expert): the prior's counts (pyzipmoe.plan.prior.from_routing)
    tokens: int  # prompt and generated tokens run
    chat: bool  # the prompts ran as chat turns in the model's template, else as plain completions


def record_routing(store: ModelDirectory, name: str, progress: Progress, *,
                   prompts: tuple[str, ...] = PROMPTS, max_tokens: int = PROMPT_TOKENS) -> RecordedRouting:
    """Runs `prompts` through the stored model `name` and returns the counts of the routing recorded."""
    from ..plan import prior
    from .directory import llama_from_store

    package = store.open(name)  # (a zipmoe GGUF: the store converts what it is given)
    llm = llama_from_store(name, zipmoe_models=store.root, record_routing=True, memory_budget=None,
                           n_ctx=1024, verbose=False)
    chat = bool(package.template or llm.metadata.get("tokenizer.chat_template"))
    tokens = 0
    progress.start("calibrate: routing", len(prompts), unit="prompt")
    try:
        for text in prompts:
            out: Any = (llm.create_chat_completion([{"role": "user", "content": text}], max_tokens=max_tokens,
                                                   temperature=0.0)
                        if chat else llm(text, max_tokens=max_tokens, temperature=0.0))
            tokens += int(out["usage"]["total_tokens"])
            llm.reset()
            progress.advance(1)
        counts = prior.from_routing(llm.recorded_routing())
    finally:
        progress.close()
        llm.close()
    return RecordedRouting(counts, tokens, chat)
