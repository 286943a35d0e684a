"""Model names as Ollama spells them: [HOST/][NAMESPACE/]MODEL[:TAG], parsed and validated; and the errors of
pyzipmoe.models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ZipmoeError


DEFAULT_HOST = "zipmoe.local"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"


class ModelsError(ZipmoeError):
    """The store cannot do what was asked (exit status 2)."""


class ModelNotFoundError(ModelsError):
    """No model of that name (exit status 2, as for a missing file: pyzipmoe.errors.EXIT_STATUSES)."""


class InvalidNameError(ModelsError):
    """Not a model name by Ollama's rules."""


# ------------------------------------------------------------------------------------------ names


_HOST = re.compile(r"[a-z0-9][a-z0-9._-]{0,349}(?::[0-9]{1,5})?")
_NAMESPACE = re.compile(r"[a-z0-9][a-z0-9_-]{0,79}")
_MODEL = re.compile(r"[a-z0-9][a-z0-9_.-]{0,79}")
_TAG = re.compile(r"[a-z0-9_][a-z0-9_.-]{0,79}")
_RULES = {
    "host": (_HOST, ("a host is letters, digits, '.', '_' or '-' (at most 350), starting with a letter or digit, "
                     "with an optional :port")),
    "namespace": (_NAMESPACE, "a namespace is 1-80 letters, digits, '_' or '-', starting with a letter or digit"),
    "model": (_MODEL, "a model name is 1-80 letters, digits, '_', '.' or '-', starting with a letter or digit"),
    "tag": (_TAG, "a tag is 1-80 letters, digits, '_', '.' or '-', not starting with '.' or '-'"),
}
NAME_HELP = "[HOST/][NAMESPACE/]MODEL[:TAG], e.g. mymodel, mymodel:v2, me/mymodel:latest"


@dataclass(frozen=True, order=True)
class ModelName:
    """host/namespace/model:tag, as Ollama spells model names; lower case (names are case-insensitive)."""

    host: str
    namespace: str
    model: str
    tag: str

    @classmethod
    def parse(cls, text: str) -> ModelName:
        """`model`, `ns/model`, `host/ns/model`, each with an optional `:tag` (default: latest)."""
        raw = str(text).strip()
        bad = f"invalid model name {raw!r}: expected {NAME_HELP}"
        if "@" in raw:
            raise InvalidNameError(f"{bad} (digest references are not supported)")
        rest, tag = raw, DEFAULT_TAG
        colon = raw.rfind(":")
        if colon > raw.rfind("/"):
            rest, tag = raw[:colon], raw[colon + 1:]
        parts = rest.split("/")
        if len(parts) > 3 or not all(parts):
            raise InvalidNameError(bad)
        host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
        if len(parts) == 3:
            host, namespace, model = parts
        elif len(parts) == 2:
            namespace, model = parts
        else:
            model = parts[0]
        return cls.of(host, namespace, model, tag, shown=raw)

    @classmethod
    def of(cls, host: str, namespace: str, model: str, tag: str, shown: str | None = None) -> ModelName:
        values = {"host": host.lower(), "namespace": namespace.lower(), "model": model.lower(), "tag": tag.lower()}
        for part, value in values.items():
            pattern, rule = _RULES[part]
            if not pattern.fullmatch(value):
                raise InvalidNameError(f"invalid model name {shown or f'{host}/{namespace}/{model}:{tag}'!r}: {rule}")
        return cls(**values)

    def __str__(self) -> str:
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    @property
    def display(self) -> str:
        """The short form people type: defaults left out, as `ollama list` shows names."""
        if self.host != DEFAULT_HOST:
            return str(self)
        if self.namespace != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    @property
    def parts(self) -> tuple[str, str, str, str]:
        return self.host, self.namespace, self.model, self.tag


def as_name(name: str | ModelName) -> ModelName:
    return name if isinstance(name, ModelName) else ModelName.parse(name)
