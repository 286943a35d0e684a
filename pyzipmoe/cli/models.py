"""`zipmoe create / list / show / cp / rm / prune / export / import`: models by name, as Ollama taught people.

The zipmoe command (pyzipmoe.cli) calls `register(subparsers)`; pyzipmoe.models.directory.resolve_model is what
`zipmoe run NAME` and `zipmoe serve NAME` use to accept a model's name as well as a GGUF path. Nothing loads the
native library until a command needs it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..models.modelfile import PARAMETERS, ModelfileError, format_parameter
from ..models.modelfile import parse as parse_modelfile
from ..progress import for_terminal
from .formatting import add_report_flags, command, human_size, positive
from ..models.name import NAME_HELP
from ..models.package import ModelPackage
from ..models.directory import ModelDirectory, resolve_model

__all__ = ["register", "resolve_model"]

MODELS_HELP = "the model store (default: $ZIPMOE_MODELS, else ~/.zipmoe/models)"


# ------------------------------------------------------------------------------------------ formatting


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Left-aligned columns (names and IDs read better that way; sizes are pre-formatted)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("   ".join(f"{c:<{w}}" for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def ago(seconds: float) -> str:
    """How `ollama list` says when: "2 minutes ago"."""
    seconds = max(0.0, seconds)
    if seconds < 5:
        return "just now"
    for unit, size in (("year", 365 * 86400), ("month", 30 * 86400), ("week", 7 * 86400), ("day", 86400),
                       ("hour", 3600), ("minute", 60), ("second", 1)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''} ago"
    raise AssertionError("unreachable")


def _count(n: int | None) -> str:
    """Parameter counts as models are named: 30.5B, 1.2M."""
    if not n:
        return "-"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, ensure_ascii=False))


def _models(args: argparse.Namespace) -> ModelDirectory:
    return ModelDirectory(args.models)


# ------------------------------------------------------------------------------------------ commands


def cmd_create(args: argparse.Namespace) -> int:
    if args.file == "-":
        text, source, base_dir = sys.stdin.read(), "<stdin>", Path.cwd()
    else:
        path = Path(args.file)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ModelfileError("no such file (give the Modelfile with -f FILE)", source=str(path)) from None
        except UnicodeDecodeError:
            raise ModelfileError("not UTF-8 text; is it really a Modelfile?", source=str(path)) from None
        source, base_dir = str(path), path.resolve().parent
    mf = parse_modelfile(text, source)
    for warning in mf.warnings:
        print(f"zipmoe: warning: {warning}", file=sys.stderr)
    report = _models(args).create(args.name, mf, base_dir=base_dir, codec=args.codec, level=args.level,
                                 chunk_n=args.chunk_size, threads=args.threads,
                                 progress=for_terminal(args.quiet or args.json))
    if args.json:
        _print_json(report.to_dict())
    elif not args.quiet:
        if report.converted:
            print(f"converted {report.source} ({human_size(report.source_size)}) to a "
                  f"{human_size(report.model_size)} zipmoe GGUF ({report.model_size / report.source_size:.1%})")
        elif report.model_reused:
            print(f"model {report.model_digest[7:19]} is already in the store ({human_size(report.model_size)}): "
                  "nothing to convert or copy")
        else:
            print(f"copied {report.source} ({human_size(report.model_size)}) into the store")
        print(f"created {report.name} (ID {report.id}) in {report.seconds:.1f} s; "
              f"try: zipmoe run {report.name.removesuffix(':latest')}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    entries = _models(args).list_models()
    if args.json:
        _print_json({"models": [e.to_dict() for e in entries]})
        return 0
    now = time.time()
    rows = [(e.name.display, e.id or "-", human_size(e.size) if not e.problem else "-",
             ago(now - e.modified) if not e.problem else f"unusable: {e.problem}") for e in entries]
    print(_table(("NAME", "ID", "SIZE", "MODIFIED"), rows))
    return 0


def _model_rows(pkg: ModelPackage) -> list[tuple[str, str]]:
    c, z = pkg.config, pkg.config.get("zipmoe", {})
    source = z.get("source", {})
    size = pkg.manifest.model.size
    rows = [("name", pkg.name.display), ("id", pkg.id), ("architecture", str(c.get("architecture") or "-")),
            ("parameters", _count(c.get("parameters"))),
            ("context length", str(c.get("context_length") or "-")),
            ("embedding length", str(c.get("embedding_length") or "-"))]
    if c.get("expert_count"):
        rows.append(("experts", f"{c['expert_count']}, {c.get('expert_used_count') or '?'} used per token"))
    ratio = f" ({size / source['size']:.1%} of the BF16 source, {human_size(source['size'])})" if source.get(
        "size") else ""
    rows += [("size", f"{human_size(size)}{ratio}"),
             ("codec", f"{z.get('codec', '?')}" + (f" level {z['codec_level']}" if z.get("codec") == "zstd" else "")
              + f", {z.get('chunk_size', '?')} values per chunk"),
             ("source sha256", str(source.get("sha256", "-"))),
             ("file", str(pkg.model_path))]
    prior = pkg.prior()
    if prior is not None:
        runs = prior["runs"]
        learned = f", learned from {runs} run{'s' if runs != 1 else ''}" if runs else ""
        rows.append(("prior", prior["error"] or f"{prior['tokens']} tokens{learned}"))
    return rows


def _indent(text: str, n: int = 4) -> str:
    return "\n".join(" " * n + line if line else "" for line in text.splitlines())


def cmd_show(args: argparse.Namespace) -> int:
    pkg = _models(args).open(args.name, full_check=args.verify, progress=for_terminal(args.json))
    params = [(name, format_parameter(v, name)) for name, value in pkg.parameters.items()
              for v in (value if PARAMETERS[name].repeat else [value])]
    if args.json:
        _print_json({**pkg.to_dict(), "verified": "full" if args.verify else "quick"})
    elif args.modelfile:
        sys.stdout.write(pkg.modelfile_text())
    elif args.parameters:
        for name, value in params:
            print(f"{name:<20}{json.dumps(value, ensure_ascii=False) if name == 'stop' else value}")
    elif args.template:
        _print_text(pkg.template or "")
    elif args.system:
        _print_text(pkg.system or "")
    elif args.license:
        _print_text("\n\n".join(pkg.license))
    else:
        sections = [("Model", "\n".join(f"    {k:<20}{v}" for k, v in _model_rows(pkg)))]
        if params:
            sections.append(("Parameters", "\n".join(
                f"    {n:<20}{json.dumps(v, ensure_ascii=False) if n == 'stop' else v}" for n, v in params)))
        if pkg.system:
            sections.append(("System", _indent(pkg.system)))
        if pkg.template:
            sections.append(("Template", f"    {len(pkg.template.splitlines())} lines (zipmoe show --template)"))
        if pkg.messages:
            sections.append(("Messages", "\n".join(f"    {m.role:<10}{_one_line(m.content)}" for m in pkg.messages)))
        if pkg.license:
            first = pkg.license[0].strip().splitlines()
            sections.append(("License", _indent("\n".join(first[:2]) + ("\n..." if len(first) > 2 else ""))))
        print("\n\n".join(f"  {title}\n{body}" for title, body in sections))
        if args.verify:
            print("\n  every blob was hashed and matches its sha256")
    return 0


def _print_text(text: str) -> None:
    """A stored text as it is, ending with a newline (added where it has none), as a terminal and `wc -l` expect;
    nothing for an empty one."""
    sys.stdout.write(text if not text or text.endswith("\n") else text + "\n")


def _one_line(text: str, width: int = 70) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def cmd_cp(args: argparse.Namespace) -> int:
    models = _models(args)
    dst = models.copy(args.src, args.dst)
    print(f"copied {args.src} to {dst.display}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    models = _models(args)
    for name in args.names:
        blobs, freed = models.remove(name)
        print(f"deleted {name}" + (f" (freed {human_size(freed)})" if blobs else ""))
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    report = _models(args).prune(dry_run=args.dry_run)
    if args.json:
        _print_json(report.to_dict())
        return 0
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {len(report.blobs)} unreferenced blob{'s' * (len(report.blobs) != 1)} "
          f"({human_size(report.bytes)}) and {report.jobs} leftover{'s' * (report.jobs != 1)} of interrupted "
          "creates or imports")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    report = _models(args).export(args.name, args.file, progress=for_terminal(args.quiet))
    if not args.quiet:
        print(f"exported {report.names[0]} to {report.path} ({human_size(report.bytes)}) in {report.seconds:.1f} s")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    def announce(plan: Any) -> None:
        if not args.quiet:
            print(f"adding {plan.name}{' (replacing it)' if plan.replaces else ''}: {plan.new_blobs} new "
                  f"blob{'s' * (plan.new_blobs != 1)} ({human_size(plan.new_bytes)})", flush=True)

    report = _models(args).import_(args.file, args.name, force=args.force, progress=for_terminal(args.quiet),
                                   announce=announce)
    if not args.quiet:
        print(f"imported {', '.join(report.names)} from {report.path} ({report.new_blobs} new "
              f"blob{'s' * (report.new_blobs != 1)}) in {report.seconds:.1f} s")
    return 0


# ------------------------------------------------------------------------------------------ parsing


def _models_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", metavar="DIR", help=MODELS_HELP)


def register(sub: Any) -> None:
    """Adds the model-store commands to the `zipmoe` command's subparsers."""
    from ..file import codec

    def add(name: str, run: Any, help_: str, description: str, examples: str, **kw: Any) -> argparse.ArgumentParser:
        return command(sub, name, run, description, help=help_, epilog=f"examples:\n{examples}",
                       **kw)

    p = add("create", cmd_create, "create a model from a Modelfile",
            "Create (or replace) model NAME from a Modelfile, as `ollama create` does. FROM is a BF16 MoE GGUF "
            "(converted to a zipmoe GGUF; a later create from the same file reuses the conversion), a zipmoe GGUF, "
            "or a stored model (whose template, system prompt and parameters the Modelfile can override). Also: "
            "PARAMETER (temperature, top_k, top_p, min_p, repeat_penalty, num_ctx, num_predict, stop, seed, ..., "
            "and zipmoe's memory_budget, cache_policy and cache_mode, which take what --memory-budget, --policy and "
            "--cache take; a memory_budget of a fixed size must hold the model's minimum), TEMPLATE (a Jinja chat "
            "template), SYSTEM, MESSAGE, LICENSE. "
            f"NAME is {NAME_HELP}.",
            "  zipmoe create mymodel -f Modelfile\n"
            "  zipmoe create me/qwen3moe:chat -f Modelfile --codec zstd --level 3\n"
            "  printf 'FROM ./model-bf16.gguf\\nPARAMETER temperature 0.2\\n' | zipmoe create mymodel -f -\n\n"
            "a Modelfile:\n"
            "  FROM ./model-bf16.gguf\n"
            "  PARAMETER temperature 0.7\n"
            "  PARAMETER num_ctx 4096\n"
            "  PARAMETER stop \"<|im_end|>\"\n"
            "  PARAMETER memory_budget 60%\n"
            "  PARAMETER cache_policy lru\n"
            "  SYSTEM You answer in one sentence.")
    p.add_argument("name", metavar="NAME", help="the model's name")
    p.add_argument("-f", "--file", default="Modelfile", metavar="FILE",
                   help="the Modelfile; - reads it from stdin (default: ./Modelfile)")
    p.add_argument("--codec", choices=("auto", "huff", "esc", "zstd"), default="auto",
                   help=f"exponent codec when FROM is converted (auto = {codec.DEFAULT_CODEC})")
    p.add_argument("--level", type=int, metavar="N",
                   help=f"zstd level (default: {codec.DEFAULT_ZSTD_LEVEL}; zstd only)")
    p.add_argument("--chunk-size", type=positive, metavar="N",
                   help=f"BF16 values per independently decodable chunk (default: {codec.DEFAULT_CHUNK_N})")
    p.add_argument("--threads", type=positive, metavar="N", help="conversion threads (default: all CPUs)")
    add_report_flags(p, json_help="print the report as JSON", quiet_help="no progress bars, no report")
    _models_option(p)

    for name, aliases in (("list", ["ls"]),):
        p = add(name, cmd_list, "list the stored models",
                "The stored models, most recently changed first: name, ID (the start of the manifest's sha256, "
                "as in Ollama), size on disk and when it changed.",
                "  zipmoe list\n  zipmoe list --json | jq -r '.models[].name'", aliases=aliases)
        p.add_argument("--json", action="store_true", help="print the list as JSON")
        _models_option(p)

    p = add("show", cmd_show, "show a model's details, parameters or Modelfile",
            "Architecture, size, codec, parameters, system prompt and license of a stored model; or one of them "
            "alone. Every blob is checked against its sha256 first (the model blob quickly: its sha256 is recomputed "
            "when the file changed since it was last hashed; --verify always recomputes it).",
            "  zipmoe show mymodel\n  zipmoe show mymodel --modelfile > Modelfile.mine\n"
            "  zipmoe show mymodel --json\n  zipmoe show mymodel --verify")
    p.add_argument("name", metavar="NAME", help="a model name")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--modelfile", action="store_true", help="print a Modelfile that creates this model")
    only.add_argument("--parameters", action="store_true", help="print the parameters only")
    only.add_argument("--template", action="store_true", help="print the template only")
    only.add_argument("--system", action="store_true", help="print the system prompt only")
    only.add_argument("--license", action="store_true", help="print the license(s) only")
    only.add_argument("--json", action="store_true", help="print everything as JSON")
    p.add_argument("--verify", action="store_true", help="recompute the sha256 of the model blob too")
    _models_option(p)

    p = add("cp", cmd_cp, "copy a model under another name",
            "Give model SRC a second name DST (replacing DST if it exists). Only the manifest is copied: the blobs "
            "are shared.", "  zipmoe cp mymodel mymodel:backup\n  zipmoe cp mymodel me/mymodel:v1")
    p.add_argument("src", metavar="SRC", help="the stored model to copy")
    p.add_argument("dst", metavar="DST", help=f"its new name ({NAME_HELP})")
    _models_option(p)

    p = add("rm", cmd_rm, "remove models",
            "Remove each model NAME, and the blobs that no other model uses.",
            "  zipmoe rm mymodel\n  zipmoe rm mymodel:backup me/mymodel:v1")
    p.add_argument("names", nargs="+", metavar="NAME", help="the stored models to remove")
    _models_option(p)

    p = add("prune", cmd_prune, "remove unreferenced blobs and leftovers of interrupted creates",
            "Remove the blobs that no model references and what interrupted creates or imports left behind.",
            "  zipmoe prune --dry-run\n  zipmoe prune")
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _models_option(p)

    p = add("export", cmd_export, "write a model to a tar file",
            "Write model NAME to FILE, a tar with the store's layout (manifests/... and blobs/sha256-...). Each "
            "blob is checked against its sha256 as it is written; FILE appears only when complete.",
            "  zipmoe export mymodel mymodel.tar\n  zipmoe export me/mymodel:v1 /backup/mymodel-v1.tar")
    p.add_argument("name", metavar="NAME", help="the stored model to export")
    p.add_argument("file", metavar="FILE", help="the tar file to write (replaced if it exists)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no report")
    _models_option(p)

    p = add("import", cmd_import, "add the model of a tar file written by export",
            "Add the model in FILE (written by `zipmoe export`), under NAME if given. Every blob is checked against "
            "its sha256 and the archive's manifest; blobs the store already has are stored once. All or nothing: "
            "a refused or interrupted import leaves the store as it was. A model of that name is not replaced "
            "unless --force is given.",
            "  zipmoe import mymodel.tar\n  zipmoe import mymodel.tar mymodel:restored")
    p.add_argument("file", metavar="FILE", help="a tar file written by `zipmoe export`")
    p.add_argument("name", nargs="?", metavar="NAME",
                   help="the name to give it (default: the name it was exported with)")
    p.add_argument("--force", action="store_true", help="replace a model of that name")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no report")
    _models_option(p)
