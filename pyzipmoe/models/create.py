"""`zipmoe create`: a model package from a Modelfile, its FROM converted once (a later create from the same file
reuses the result), blobs staged in a job and committed with the manifest.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import modelfile as mfile
from ..progress import Progress, Silent
from .blobs import Job, _atomic_file, hash_file, read_chunks, stat_key
from .manifest import (
    Layer,
    MEDIA_CONFIG,
    MEDIA_LICENSE,
    MEDIA_MESSAGES,
    MEDIA_MODEL,
    MEDIA_PARAMS,
    MEDIA_SYSTEM,
    MEDIA_TEMPLATE,
    Manifest,
    DIGEST,
    sha256_digest,
)
from .modelfile import Modelfile
from .name import InvalidNameError, ModelName, ModelNotFoundError, ModelsError, as_name
from .package import ModelPackage


@dataclass(frozen=True)
class CreateReport:
    name: str
    id: str
    digest: str
    model_digest: str
    model_size: int
    source: str  # the FROM: a file or a stored model
    source_size: int
    converted: bool  # a BF16 source was converted by this create
    model_reused: bool  # the model blob was already in the store: nothing new was written for it
    new_blobs: int
    new_bytes: int
    seconds: float
    convert: dict[str, Any] | None = None  # ConvertReport.to_dict() when converted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Creating:
    """ModelDirectory's create (pyzipmoe.models.create): a Modelfile to a model package."""

    def create(self, name: str | ModelName, modelfile: Modelfile | str, *, base_dir: str | os.PathLike[str] = ".",
               codec: str = "auto", level: int | None = None, chunk_n: int | None = None, threads: int | None = None,
               progress: Progress | None = None) -> CreateReport:
        """Creates (or replaces) model `name` from a Modelfile (text or parsed). FROM is a MoE GGUF of BF16 or F16
        experts (converted with codec/level/chunk_n, once: a later create from the same file reuses the result),
        one of quantized experts (stored as it is, its experts served from the cache under a budget), a zipmoe
        GGUF, or a stored model (whose layers are inherited; the Modelfile's directives replace them)."""
        from ..file import codec as zcodec

        t0 = time.monotonic()
        name = as_name(name)
        settings = _codec_settings(zcodec, codec, level, chunk_n)  # bad options fail before any work
        mf = mfile.parse(modelfile) if isinstance(modelfile, str) else modelfile
        progress = progress or Silent()
        base_dir = Path(base_dir)
        self._ensure()
        try:
            with Job(self) as job:
                base, source = None, self._from_file(mf, base_dir)
                if not source.exists():
                    base = self._from_model(mf, source)
                    _check_budget(mf, {**base.parameters, **mf.parameters}, base.model_path)
                    model, config, info = base.manifest.model, base.manifest.config, {
                        "source": base.name.display, "source_size": base.manifest.model.size, "converted": False,
                        "model_reused": True, "convert": None}
                else:
                    _check_budget(mf, mf.parameters, source)  # before a conversion that would be wasted
                    model, info = self._model_blob(job, source, settings, threads, progress)
                    model_path = job.staged.get(model.hex) or self.blob_path(model.digest)
                    config = job.stage_bytes(self._config_bytes(model_path, model.size), MEDIA_CONFIG)
                layers = [model, *self._package_layers(job, mf, base)]
                manifest = Manifest(Layer(MEDIA_CONFIG, config.digest, config.size), tuple(layers))
                digest, new, new_bytes = self._commit(name, manifest, job)
        finally:
            progress.close()
        return CreateReport(name.display, digest[:12], f"sha256:{digest}", model.digest, model.size, info["source"],
                            info["source_size"], info["converted"], info["model_reused"], new, new_bytes,
                            time.monotonic() - t0, info["convert"])

    @staticmethod
    def _from_file(mf: Modelfile, base_dir: Path) -> Path:
        """Where FROM would be as a file: relative to the Modelfile's directory, ~ expanded (as Ollama does)."""
        path = Path(os.path.expanduser(mf.from_))
        if not path.is_absolute():
            path = base_dir / path
        if path.is_dir():
            raise mf.error(f"FROM {mf.from_}: {path} is a directory; FROM takes a GGUF file or a model name")
        if path.exists() and not path.is_file():  # a FIFO or a device would block or never end
            raise mf.error(f"FROM {mf.from_}: {path} is not a regular file; FROM takes a GGUF file or a model name")
        return path

    def _from_model(self, mf: Modelfile, looked_at: Path) -> ModelPackage:
        try:
            name = ModelName.parse(mf.from_)
        except InvalidNameError:
            raise mf.error(f"FROM {mf.from_}: no such file ({looked_at})") from None
        try:
            return self.open(name)
        except ModelNotFoundError:
            raise mf.error(f"FROM {mf.from_}: no such file ({looked_at}), and no model {name.display!r} in "
                           f"{self.root}") from None

    def _model_blob(self, job: Job, source: Path, settings: Mapping[str, Any], threads: int | None,
                    progress: Progress) -> tuple[Layer, dict[str, Any]]:
        """The model layer for a GGUF file: reused when the store has it, else staged (copied or converted)."""
        from ..file import codec as zcodec
        from ..file import convert
        from ..file.gguf import GGML_TYPE_BF16, GGML_TYPE_F16, read_gguf
        from ..file.metadata import is_expert_tensor

        g = read_gguf(source)
        source_hex, source_size = self._source_digest(source, progress)
        info: dict[str, Any] = {"source": str(source), "source_size": source_size, "converted": False,
                                "model_reused": True, "convert": None}
        # a GGUF whose experts are all quantized (or F32) is stored as it is: conversion would save 0.5-4% of them
        # (docs/FORMAT.md), and the runtime serves a plain GGUF's experts from its cache under a budget alike
        experts = [t for t in g.tensors if is_expert_tensor(t)]  # (none: convert says it is not a MoE model)
        coded = (GGML_TYPE_BF16, GGML_TYPE_F16)
        as_is = g.is_zipmoe or bool(experts) and not any(t.ggml_type in coded for t in experts)
        if as_is:
            if g.is_zipmoe:
                from ..file.reader import open_zipmoe

                open_zipmoe(source)  # refuse a damaged file before it enters the store
            if self._intact(source_hex, source_size):
                return Layer(MEDIA_MODEL, f"sha256:{source_hex}", source_size), info
            with open(source, "rb", buffering=0) as f:
                progress.start(f"copy {source.name}", source_size)
                staged = job.stage_chunks(read_chunks(f), progress)
            if staged.hex != source_hex:
                self._source_record(source).unlink(missing_ok=True)
                raise ModelsError(f"{source} changed while it was being read; run the command again")
            return Layer(MEDIA_MODEL, staged.digest, staged.size), {**info, "model_reused": False}
        found = self._find_converted(source_hex, settings)
        if found is not None:
            return found, info
        out = job.path("model.zipmoe.gguf")
        report = convert.convert(source, out, codec=settings["codec"],
                                 level=settings["codec_level"] if settings["codec"] == "zstd"
                                 else zcodec.DEFAULT_ZSTD_LEVEL,
                                 chunk_n=settings["chunk_size"], threads=threads, progress=progress)
        if report.sha256 != source_hex:
            self._source_record(source).unlink(missing_ok=True)  # hash it afresh next time
            raise ModelsError(f"{source} changed while it was being converted; run the command again")
        hex_, size = hash_file(out, progress, "hash the converted model")
        job.adopt(out, hex_, size)
        return Layer(MEDIA_MODEL, f"sha256:{hex_}", size), {**info, "converted": True, "model_reused": False,
                                                           "convert": report.to_dict()}

    def _source_digest(self, source: Path, progress: Progress) -> tuple[str, int]:
        """The sha256 and size of a FROM file. Remembered with the file's stat, so that creating from the same
        unchanged file again (say, to change the system prompt) does not read a 60 GB file again: any write to
        the file changes its ctime. The stat is taken before hashing, so a file changed meanwhile is hashed again
        next time; convert also checks the sha256 it computes itself."""
        real = source.resolve()
        record = self._source_record(real)
        stat = stat_key(real)
        try:
            saved = json.loads(record.read_bytes())
            if saved["stat"] == stat and DIGEST.fullmatch("sha256:" + saved["sha256"]):
                return saved["sha256"], stat[0]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        hex_, size = hash_file(real, progress, f"hash {source.name}")
        with contextlib.suppress(OSError):
            record.parent.mkdir(exist_ok=True)
            with _atomic_file(record) as f:
                f.write(json.dumps({"path": str(real), "stat": stat, "sha256": hex_}).encode())
        return hex_, size

    def _source_record(self, path: Path) -> Path:
        return self.state_dir / "sources" / sha256_digest(str(path.resolve()).encode())

    def _find_converted(self, source_hex: str, settings: Mapping[str, Any]) -> Layer | None:
        """A stored model blob converted from the source with sha256 source_hex with these codec settings.
        Conversion is deterministic, so it is the blob this create would write; looked up through the configs
        (which record zipmoe.source.sha256 and the codec settings), so no separate index can go stale."""
        rejected = set()  # tags of one model share its blob: a damaged one is hashed once
        for parts, path in self._manifest_files():
            try:
                manifest = Manifest.from_bytes(path.read_bytes(), str(path))
                if manifest.model.hex in rejected:
                    continue
                config = json.loads(self._read_small(manifest.config, "/".join(parts), "config"))
                z = config["zipmoe"]
                if z["source"]["sha256"] != source_hex or any(z[k] != v for k, v in settings.items()):
                    continue
            except (OSError, ValueError, KeyError, TypeError, ModelsError):
                continue
            if self._intact(manifest.model.hex, manifest.model.size):
                return manifest.model
            rejected.add(manifest.model.hex)
        return None

    @staticmethod
    def _config_bytes(model_path: Path, size: int) -> bytes:
        """The config blob: what `show` and `list` tell about the model, and the conversion's provenance (a plain
        GGUF stored as it is has none: "zipmoe" null, "expert_types" its experts' ggml types)."""
        from ..file.gguf import read_gguf, type_name
        from ..file.metadata import is_expert_tensor
        from ..file.reader import open_zipmoe

        g = read_gguf(model_path)
        zf = open_zipmoe(model_path) if g.is_zipmoe else None
        kv, tensors = g.kv, zf.source.tensors if zf is not None else g.tensors
        arch = kv["general.architecture"].value if "general.architecture" in kv else None

        def scalar(key: str) -> Any:
            entry = kv.get(key)
            return entry.value if entry is not None and isinstance(entry.value, (int, float, str)) else None

        config = {
            "format": "gguf", "file_type": "zipmoe" if zf is not None else "plain", "architecture": arch,
            "model_name": scalar("general.name"), "parameters": sum(math.prod(t.dims) for t in tensors),
            "context_length": scalar(f"{arch}.context_length"), "embedding_length": scalar(f"{arch}.embedding_length"),
            "block_count": scalar(f"{arch}.block_count"), "expert_count": scalar(f"{arch}.expert_count"),
            "expert_used_count": scalar(f"{arch}.expert_used_count"), "size": size,
            "expert_types": sorted({type_name(t.ggml_type) for t in tensors if is_expert_tensor(t)}),
            "zipmoe": None,
        }
        if zf is not None:
            meta = zf.meta
            config["zipmoe"] = {"version": meta.version, "codec": meta.codec, "codec_level": meta.level,
                                "chunk_size": meta.chunk_size, "tensors": len(meta.tensors),
                                "source": {"sha256": meta.source_sha256, "size": meta.source_size}}
        return json.dumps(config, indent=2).encode()

    @staticmethod
    def _package_layers(job: Job, mf: Modelfile, base: ModelPackage | None) -> list[Layer]:
        """Template, system, licenses, messages and parameters: the Modelfile's, else the base model's."""
        template = mf.template if mf.template is not None else (base.template if base else None)
        system = mf.system if mf.system is not None else (base.system if base else None)
        licenses = mf.license or (base.license if base else ())
        messages = mf.messages or (base.messages if base else ())
        params = {**(base.parameters if base else {}), **mf.parameters}
        layers = []
        if template is not None:
            layers.append(job.stage_bytes(template.encode(), MEDIA_TEMPLATE))
        if system is not None:
            layers.append(job.stage_bytes(system.encode(), MEDIA_SYSTEM))
        layers += [job.stage_bytes(text.encode(), MEDIA_LICENSE) for text in licenses]
        if messages:
            layers.append(job.stage_bytes(json.dumps([m.to_dict() for m in messages], ensure_ascii=False).encode(),
                                          MEDIA_MESSAGES))
        if params:
            layers.append(job.stage_bytes(json.dumps(params, ensure_ascii=False).encode(), MEDIA_PARAMS))
        return layers


def _check_budget(mf: Modelfile, params: Mapping[str, Any], model: Path) -> None:
    """A memory_budget of a fixed size must hold the model's minimum (pyzipmoe.runtime.budget.check_budget, what a
    run would refuse it with); "auto" and percentages depend on the machine the model runs on and are checked
    there. `model` is the FROM file (its minimum is its converted file's: the same weights that are not experts
    and the same experts in flight) or the base model's."""
    from ..errors import ZipmoeError
    from ..file.gguf import read_gguf
    from ..file.metadata import is_expert_tensor
    from ..runtime.budget import check_budget, model_memory

    budget = params.get("memory_budget")
    if not isinstance(budget, int):
        return
    g = read_gguf(model)
    if not g.is_zipmoe and not any(is_expert_tensor(t) for t in g.tensors):
        return  # not a MoE model: conversion refuses it with its own reason
    try:
        check_budget(budget, model_memory(model), mfile.format_size(budget))
    except ZipmoeError as e:
        said = str(e).removeprefix("memory budget ").removesuffix("; raise --memory-budget")
        raise mf.error(f"PARAMETER memory_budget {said}; raise it, or write auto", "memory_budget") from None


def _codec_settings(zcodec: Any, codec: str, level: int | None, chunk_n: int | None) -> dict[str, Any]:
    """The settings that decide a conversion's bytes, as the config records them (so they can be looked up)."""
    name = zcodec.DEFAULT_CODEC if codec == "auto" else codec
    if name not in zcodec.CODECS:
        raise ModelsError(f"unknown codec {codec!r}; choose auto, {', '.join(zcodec.CODECS)}")
    if level is not None and name != "zstd":
        raise ModelsError("a codec level applies to the zstd codec only")
    return {"codec": name, "codec_level": (zcodec.DEFAULT_ZSTD_LEVEL if level is None else level) if name == "zstd"
            else 0, "chunk_size": zcodec.DEFAULT_CHUNK_N if chunk_n is None else chunk_n}
