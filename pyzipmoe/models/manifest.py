"""A model's manifest (schemaVersion 2, as Ollama's): its config blob and layers, each a blob named by its sha256
digest, with zipmoe's media types.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import modelfile as mfile
from .name import ModelsError


MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"  # what Ollama's manifests say too
MEDIA_CONFIG = "application/vnd.zipmoe.config.v1+json"
MEDIA_MODEL = "application/vnd.zipmoe.model"
MEDIA_PARAMS = "application/vnd.zipmoe.params"
MEDIA_TEMPLATE = "application/vnd.zipmoe.template"
MEDIA_SYSTEM = "application/vnd.zipmoe.system"
MEDIA_LICENSE = "application/vnd.zipmoe.license"
MEDIA_MESSAGES = "application/vnd.zipmoe.messages"
LAYER_TYPES = (MEDIA_MODEL, MEDIA_PARAMS, MEDIA_TEMPLATE, MEDIA_SYSTEM, MEDIA_LICENSE, MEDIA_MESSAGES)
OLLAMA_MEDIA_PREFIX = "application/vnd.ollama.image."


# ------------------------------------------------------------------------------------------ manifests


DIGEST = re.compile(r"sha256:([0-9a-f]{64})")


def digest_hex(digest: str) -> str:
    m = DIGEST.fullmatch(digest)
    if m is None:
        raise ModelsError(f"{digest!r} is not a sha256 digest")
    return m.group(1)


@dataclass(frozen=True)
class Layer:
    media_type: str
    digest: str  # sha256:<hex>
    size: int

    @property
    def hex(self) -> str:
        return digest_hex(self.digest)

    def to_json(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


@dataclass(frozen=True)
class Manifest:
    config: Layer
    layers: tuple[Layer, ...]

    def to_bytes(self) -> bytes:
        return json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE, "config": self.config.to_json(),
                           "layers": [x.to_json() for x in self.layers]}, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, label: str) -> Manifest:
        try:
            obj = json.loads(data)
            if obj.get("schemaVersion") != 2:
                raise ValueError(f"schemaVersion is {obj.get('schemaVersion')!r}, not 2")
            config = _layer(obj["config"])
            layers = tuple(_layer(x) for x in obj["layers"])
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, ModelsError) as e:
            raise ModelsError(f"{label}: not a valid manifest ({e})") from None
        for x in layers:
            if x.media_type.startswith(OLLAMA_MEDIA_PREFIX):
                raise ModelsError(f"{label}: an Ollama model ({x.media_type}), not a zipmoe one; Ollama's runner "
                                 "and zipmoe's cannot read each other's models")
            if x.media_type not in LAYER_TYPES:
                raise ModelsError(f"{label}: unknown layer type {x.media_type} (made by a newer zipmoe?)")
        if config.media_type != MEDIA_CONFIG:
            raise ModelsError(f"{label}: unknown config type {config.media_type}")
        if sum(x.media_type == MEDIA_MODEL for x in layers) != 1:
            raise ModelsError(f"{label}: a zipmoe manifest has exactly one {MEDIA_MODEL} layer")
        return cls(config, layers)

    @property
    def model(self) -> Layer:
        return next(x for x in self.layers if x.media_type == MEDIA_MODEL)

    def of_type(self, media_type: str) -> list[Layer]:
        return [x for x in self.layers if x.media_type == media_type]

    @property
    def blobs(self) -> list[Layer]:
        return [self.config, *self.layers]

    @property
    def size(self) -> int:
        return sum(x.size for x in self.blobs)


def _layer(obj: Mapping[str, Any]) -> Layer:
    digest_hex(obj["digest"])
    size = obj["size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"bad size {size!r}")
    if not isinstance(obj["mediaType"], str):
        raise TypeError("bad mediaType")
    return Layer(obj["mediaType"], obj["digest"], size)


def sha256_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def layer_kind(layer: Layer) -> str:
    return "config" if layer.media_type == MEDIA_CONFIG else layer.media_type.rsplit(".", 1)[-1]


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and m.get("role") in mfile.ROLES and isinstance(m.get("content"), str)
