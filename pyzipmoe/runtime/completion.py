"""A loaded llama_cpp.Llama made to complete as a model package says: its TEMPLATE formats chat turns, its SYSTEM and
MESSAGE history come before the caller's messages, its sampling parameters are the defaults of both kinds of
completion. The runtime applies it (`zipmoe run` of a stored model, pyzipmoe.models.llama_from_store); the package
itself (pyzipmoe.models.package.ModelPackage) is anything with the three members of `CompletionDefaults`, so that
the runtime needs nothing of pyzipmoe.models, which sits above it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class CompletionDefaults(Protocol):
    """What a package gives a completion (ModelPackage has them)."""

    template: str | None

    def sampling_kwargs(self) -> dict[str, Any]: ...

    def chat_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]: ...


def apply_package(llm: Any, package: CompletionDefaults, *, chat_template: bool = True) -> None:
    """Makes a loaded llama_cpp.Llama run as the package says (see llama_from_store). Wraps the instance's
    create_completion and create_chat_completion (only this instance; __call__ goes through them)."""
    llm.zipmoe_package = package
    if chat_template and package.template:
        from llama_cpp import llama_chat_format

        eos, bos = llm.token_eos(), llm.token_bos()
        llm.chat_handler = llama_chat_format.Jinja2ChatFormatter(
            template=package.template,
            eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
            bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
            stop_token_ids=[eos]).to_chat_handler()
    defaults = package.sampling_kwargs()
    complete, chat = llm.create_completion, llm.create_chat_completion
    complete_sig, chat_sig = inspect.signature(complete), inspect.signature(chat)

    def with_defaults(sig: inspect.Signature, args: tuple[Any, ...], kw: dict[str, Any]) -> dict[str, Any]:
        given = sig.bind_partial(*args, **kw).arguments
        return {**{k: v for k, v in defaults.items() if k not in given and k in sig.parameters}, **kw}

    def create_completion(*args: Any, **kw: Any) -> Any:
        return complete(*args, **with_defaults(complete_sig, args, kw))

    def create_chat_completion(*args: Any, **kw: Any) -> Any:
        bound = chat_sig.bind_partial(*args, **kw)
        bound.arguments["messages"] = package.chat_messages(bound.arguments.get("messages", []))
        return chat(*bound.args, **with_defaults(chat_sig, bound.args, dict(bound.kwargs)))

    create_completion.__doc__, create_chat_completion.__doc__ = complete.__doc__, chat.__doc__
    llm.create_completion, llm.create_chat_completion = create_completion, create_chat_completion
