"""A loaded llama_cpp.Llama made to complete as a model package says: its TEMPLATE formats chat turns, its SYSTEM and
MESSAGE history come before the caller's messages, its sampling parameters are the defaults of both kinds of
completion. The runtime applies it (`zipmoe run` of a stored model, pyzipmoe.models.llama_from_store); the package
itself (pyzipmoe.models.package.ModelPackage) is anything with the members of `CompletionDefaults`, so that
the runtime needs nothing of pyzipmoe.models, which sits above it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

# the chat template llama.cpp gives a model that has none (common/chat.cpp's CHATML_TEMPLATE_SRC)
CHATML = ("{%- for message in messages -%}\n"
          "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
          "{%- endfor -%}\n"
          "{%- if add_generation_prompt -%}\n"
          "  {{- '<|im_start|>assistant\\n' -}}\n"
          "{%- endif -%}")


class CompletionDefaults(Protocol):
    """What a package gives a completion (ModelPackage has them)."""

    template: str | None
    system: str | None
    messages: Sequence[Any]

    def sampling_kwargs(self) -> dict[str, Any]: ...

    def chat_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]: ...


def is_chat_turn(package: CompletionDefaults | None) -> bool:
    """Whether a prompt given to a stored model is one user turn in its chat template, after its SYSTEM and MESSAGE
    lines, rather than completed as it is: where the package has a TEMPLATE, SYSTEM or MESSAGE lines, as `ollama run`
    answers (`zipmoe run NAME PROMPT`, and the server's /api/generate without `raw`)."""
    return package is not None and bool(package.template or package.system or package.messages)


def chat_handler(llm: Any, template: str | None) -> Any:
    """A llama-cpp-python chat handler that formats a conversation as llama-server does (llama.cpp's common/chat.cpp),
    so that a stored model answers the same tokens in `zipmoe run` and behind `zipmoe serve`: the template given
    (the package's TEMPLATE), else the GGUF's tokenizer.chat_template, else llama.cpp's chatml; rendered with the
    vocabulary's BOS and EOS texts; a BOS text the template starts with dropped (and an EOS text it ends with) where
    the vocabulary adds that token itself, which tokenizing with the vocabulary's special tokens then does. (llama-
    cpp-python's own: its template or a format of its own choice (llama-2) for a model without one, and the text
    tokenized without the vocabulary's BOS, so a template without `{{ bos_token }}` got none.)"""
    from llama_cpp import llama_chat_format

    model = llm._model
    source = template or llm.metadata.get("tokenizer.chat_template") or CHATML
    bos, eos = llm.token_bos(), llm.token_eos()

    def piece(token: int) -> str:
        return model.token_to_piece(token, special=True).decode("utf-8", "replace") if token != -1 else ""

    bos_text, eos_text = piece(bos), piece(eos)
    add_bos, add_eos = model.add_bos_token(), model.add_eos_token()
    jinja = llama_chat_format.Jinja2ChatFormatter(template=source, eos_token=eos_text, bos_token=bos_text)

    def format_chat(**kw: Any) -> Any:
        prompt = jinja(**kw).prompt
        if add_bos and bos_text and prompt.startswith(bos_text):
            prompt = prompt[len(bos_text):]
        if add_eos and eos_text and prompt.endswith(eos_text):
            prompt = prompt[:-len(eos_text)]
        # added_special False: tokenized with the vocabulary's own BOS (and EOS), as llama-server's prompts are
        return llama_chat_format.ChatFormatterResponse(prompt=prompt, added_special=False)

    return llama_chat_format.chat_formatter_to_chat_completion_handler(format_chat)


def apply_package(llm: Any, package: CompletionDefaults, *, chat_template: bool = True) -> None:
    """Makes a loaded llama_cpp.Llama run as the package says (see llama_from_store). Wraps the instance's
    create_completion and create_chat_completion (only this instance; __call__ goes through them). chat_template:
    format chats as llama-server would (chat_handler); False keeps the instance's own chat format."""
    llm.zipmoe_package = package
    if chat_template and _is_llama_cpp(llm):
        llm.chat_handler = chat_handler(llm, package.template)
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


def _is_llama_cpp(llm: Any) -> bool:
    """Whether llm is llama-cpp-python's (whose chat handler this module sets), not a class of its caller's."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return False
    return isinstance(llm, Llama)
