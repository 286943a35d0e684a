"""Modelfiles: Ollama's recipe format for a model package, read and written (pure: text in, text out).

    # a comment (only at the start of a line, as in Ollama)
    FROM ./qwen3moe-bf16.gguf            a BF16 MoE GGUF (converted), a zipmoe GGUF, or a stored model
    PARAMETER temperature 0.7
    PARAMETER stop "<|im_end|>"          stop may be given several times
    PARAMETER memory_budget 8GiB         zipmoe's own: memory_budget, cache_policy, cache_mode (as the flags)
    SYSTEM You are a terse assistant.
    TEMPLATE \"\"\"{% for m in messages %}...{% endfor %}\"\"\"
    MESSAGE user Is the sky blue?
    MESSAGE assistant Yes.
    LICENSE \"\"\"MIT ...\"\"\"

Syntax, as Ollama's parser reads it: one directive per line, directive names in any case; a value is the rest
of the line (trimmed), or `"..."` (which may span lines: it ends at a `"` that ends a line), or `\"\"\"...\"\"\"`
(multi-line, ends at the first `\"\"\"`). Quoted text is kept exactly, with no escapes.

Where zipmoe is stricter than Ollama, it is to turn silent surprises into errors with line numbers: unknown
directives and parameters, values of the wrong type or range, TEMPLATE/SYSTEM/FROM given twice, text after a
closing quote. zipmoe's own parameters take what the flags of `zipmoe run` take, read by the same code:
memory_budget as --memory-budget (a size, a percentage of the memory, or auto), cache_policy as --policy (the
eviction policy), cache_mode as --cache. TEMPLATE is a Jinja chat template (what llama.cpp and llama-cpp-python
run, the kind GGUFs carry in `tokenizer.chat_template`), not an Ollama Go template: `{{ .Prompt }}` is refused with
a hint.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from ..errors import ZipmoeError
from ..runtime.config import CACHE_MODES, DEFAULT_POLICY, MAX_CONTEXT, MAX_THREADS, POLICIES

DIRECTIVES = ("FROM", "PARAMETER", "TEMPLATE", "SYSTEM", "LICENSE", "MESSAGE")
# Ollama knows these; a Modelfile written for Ollama that uses them gets a reason, not just "unknown"
OLLAMA_ONLY = {
    "ADAPTER": "LoRA adapters are not supported by zipmoe",
    "DRAFT": "draft models (speculative decoding) are not supported by zipmoe",
    "RENDERER": "Ollama's built-in renderers do not exist in llama.cpp; give a Jinja TEMPLATE instead",
    "PARSER": "Ollama's built-in output parsers do not exist in llama.cpp",
    "REQUIRES": "zipmoe has no minimum-version check",
}
ROLES = ("system", "user", "assistant")
# The parameter that sets the cache mode (ZIPMOE_CACHE, Llama's zipmoe_cache, `zipmoe run --cache`; one of
# CACHE_MODES).
CACHE_MODE_PARAMETER = "cache_mode"
# The eviction policy (ZIPMOE_CACHE_POLICY, Llama's cache_policy, `zipmoe run --policy`; one of POLICIES). Older
# Modelfiles and stored packages wrote the cache mode under this name: `cache_policy unbounded` (or none) is read
# as cache_mode, with a warning for a Modelfile (the two sets of values do not meet).
CACHE_POLICY_PARAMETER = "cache_policy"

Kind = Literal["int", "float", "str", "budget", "choice"]


class ModelfileError(ZipmoeError):
    """A Modelfile that cannot be used; the message names the file and line."""

    def __init__(self, message: str, *, source: str = "Modelfile", line: int | None = None):
        where = f"{source}, line {line}" if line is not None else source
        super().__init__(f"{where}: {message}")
        self.source, self.line = source, line


@dataclass(frozen=True)
class ParamSpec:
    kind: Kind
    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] = ()
    repeat: bool = False  # may be given several times; the value is a list
    zipmoe: bool = False  # zipmoe's own, not Ollama's


PARAMETERS: Mapping[str, ParamSpec] = MappingProxyType({
    "temperature": ParamSpec("float", "sampling temperature; 0 = greedy", 0),
    "top_k": ParamSpec("int", "sample among the k most likely tokens; 0 = all", 0),
    "top_p": ParamSpec("float", "nucleus sampling: smallest set of tokens with this total probability", 0, 1),
    "min_p": ParamSpec("float", "drop tokens less likely than min_p times the most likely one", 0, 1),
    "typical_p": ParamSpec("float", "locally typical sampling; 1 = off", 0, 1),
    "repeat_penalty": ParamSpec("float", "penalty for repeating recent tokens; 1 = off", 0),
    "repeat_last_n": ParamSpec("int", "how many recent tokens repeat_penalty looks at; -1 = the context", -1),
    "presence_penalty": ParamSpec("float", "penalty for tokens that already appeared"),
    "frequency_penalty": ParamSpec("float", "penalty growing with how often a token appeared"),
    "num_ctx": ParamSpec("int", "context size in tokens", 1, MAX_CONTEXT),
    "num_predict": ParamSpec("int", "most tokens to generate; -1 = until the context is full", -1),
    "num_batch": ParamSpec("int", "prompt tokens processed per batch", 1),
    "num_thread": ParamSpec("int", "CPU threads", 1, MAX_THREADS),
    "seed": ParamSpec("int", "sampling seed: the same prompt gives the same text; -1 = random", -1, 2**32 - 1),
    "stop": ParamSpec("str", "stop generating at this text (repeat for several)", repeat=True),
    "memory_budget": ParamSpec("budget", "everything the model may keep resident, as --memory-budget takes it: a size "
                               "(8GiB, 512MiB), a percentage of the memory (60%) or auto", zipmoe=True),
    CACHE_POLICY_PARAMETER: ParamSpec("choice", f"eviction under a budget, as --policy (default {DEFAULT_POLICY})",
                                      choices=POLICIES, zipmoe=True),
    CACHE_MODE_PARAMETER: ParamSpec("choice", "zipmoe expert cache, as --cache: unbounded keeps decoded experts, none "
                                    "decodes on every use", choices=CACHE_MODES, zipmoe=True),
})


@dataclass(frozen=True)
class Message:
    role: str
    content: str

    def to_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class Modelfile:
    """What a Modelfile says. `lines` maps each directive (FROM, TEMPLATE, SYSTEM, PARAMETER name) to the line it
    was on, so later checks (such as resolving FROM) can still point at the right line."""

    from_: str
    parameters: Mapping[str, Any] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    license: tuple[str, ...] = ()
    messages: tuple[Message, ...] = ()
    source: str = "Modelfile"
    lines: Mapping[str, int] = field(default_factory=dict, compare=False)
    warnings: tuple[str, ...] = field(default=(), compare=False)  # what is accepted but should be written otherwise

    def error(self, message: str, directive: str = "FROM") -> ModelfileError:
        return ModelfileError(message, source=self.source, line=self.lines.get(directive))


# ------------------------------------------------------------------------------------------ values


def parse_size(text: str) -> int:
    """Bytes from `8GiB`, `8G`, `8GB`, `512MiB` or `1048576`: the one size parser (pyzipmoe.runtime.budget), units
    binary as `--memory-budget` and llama.cpp read them."""
    from ..runtime.budget import parse_size as parse

    return parse(text)


def format_size(n: int) -> str:
    """The shortest exact spelling parse_size reads back: 8GiB, 512MiB, 1000."""
    for unit, power in (("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if n and n % 1024**power == 0:
            return f"{n // 1024**power}{unit}"
    return str(n)


def _number(kind: Kind, text: str) -> float:
    try:
        if kind == "int":
            return int(text, 10)
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not {'a whole number' if kind == 'int' else 'a number'}") from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def parse_budget(text: str) -> int | str:
    """A memory budget as `--memory-budget` takes it, checked by the same parser (pyzipmoe.runtime.budget): bytes
    for a size, the text for what depends on the machine it runs on ("auto", "60%"). ValueError says what is wrong."""
    from ..runtime.budget import AUTO
    from ..runtime.budget import parse_budget as parse

    text = text.strip()
    if text.lower() == AUTO:
        return AUTO
    try:
        if "%" not in text:
            return parse(text)
        parse(text, total=1 << 30)  # (the share of any memory: only the spelling is checked here)
    except ZipmoeError as e:
        raise ValueError(str(e).removeprefix("memory budget ")) from None
    return "".join(text.split())


def parse_parameter(name: str, text: str) -> Any:
    """The typed value of PARAMETER name text; ValueError says what is wrong (KeyError for unknown names)."""
    spec = PARAMETERS[name]
    text = text.strip()
    if spec.kind == "str":
        if not text:
            raise ValueError("needs a non-empty value")
        return text
    if spec.kind == "choice":
        if text.lower() not in spec.choices:
            raise ValueError(f"{text!r} is not one of {', '.join(spec.choices)}")
        return text.lower()
    if spec.kind == "budget":
        return parse_budget(text)
    return check_range(name, _number(spec.kind, text))


def old_cache_mode(name: str, text: str) -> bool:
    """Whether PARAMETER name text is the old spelling of the cache mode (cache_policy unbounded|none)."""
    return name == CACHE_POLICY_PARAMETER and str(text).strip().lower() in CACHE_MODES


def check_range(name: str, value: float) -> Any:
    spec = PARAMETERS[name]
    if spec.min is not None and value < spec.min:
        raise ValueError(f"must be at least {_num(spec.min)}, got {_num(value)}")
    if spec.max is not None and value > spec.max:
        raise ValueError(f"must be at most {_num(spec.max)}, got {_num(value)}")
    return value


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def check_parameters(params: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Validates parameters that come as JSON (a stored package), with the rules PARAMETER lines follow."""
    out: dict[str, Any] = {}
    for name, value in params.items():
        if old_cache_mode(name, value) and CACHE_MODE_PARAMETER not in params:
            name = CACHE_MODE_PARAMETER  # stored by a zipmoe that spelled the cache mode cache_policy
        spec = PARAMETERS.get(name)
        if spec is None:
            raise ZipmoeError(f"{where}: unknown parameter {name!r} (made by a newer zipmoe?)")
        values = value if spec.repeat else [value]
        if spec.repeat and not (isinstance(value, list) and value):
            raise ZipmoeError(f"{where}: parameter {name} must be a non-empty list")
        checked = []
        for v in values:
            ok = {"int": isinstance(v, int) and not isinstance(v, bool),
                  "budget": (isinstance(v, int) and not isinstance(v, bool) and v >= 0) or isinstance(v, str),
                  "float": isinstance(v, (int, float)) and not isinstance(v, bool),
                  "str": isinstance(v, str) and bool(v),
                  "choice": v in spec.choices}[spec.kind]
            if not ok:
                raise ZipmoeError(f"{where}: parameter {name} has a bad value {v!r}")
            try:
                if spec.kind == "budget":
                    checked.append(v if isinstance(v, int) else parse_budget(v))
                else:
                    checked.append(v if spec.kind in ("str", "choice") else check_range(name, v))
            except ValueError as e:
                raise ZipmoeError(f"{where}: parameter {name} {e}") from None
        out[name] = checked if spec.repeat else checked[0]
    return out


def format_parameter(value: Any, name: str) -> str:
    if PARAMETERS[name].kind == "budget":
        return format_size(value) if isinstance(value, int) else str(value)
    return _num(value) if isinstance(value, (int, float)) else str(value)


# ------------------------------------------------------------------------------------------ parsing


_DIRECTIVE = re.compile(r"([A-Za-z]+)(?:[ \t]+(.*))?")
_PARAMETER = re.compile(r"([A-Za-z0-9_]+)(?:[ \t]+(.*))?")
_MESSAGE = re.compile(r"([A-Za-z]+)(?:[ \t]+(.*))?")


def _read_value(lines: list[str], i: int, rest: str, fail: Any) -> tuple[str, int]:
    """The value starting with `rest` on line i (0-based) and the index of the line after it."""
    s = rest.lstrip(" \t")  # the tail is kept: inside quotes, trailing blanks of a first line are text
    if s.startswith('"""'):
        body, k = s[3:], i
        while True:
            end = body.find('"""')
            if end >= 0:
                if body[end + 3:].strip(" \t"):
                    fail(k, f'unexpected text after the closing """: {body[end + 3:].strip()!r}')
                return body[:end] if k == i else _joined(lines, i, s[3:], k, body[:end]), k + 1
            k += 1
            if k == len(lines):
                fail(i, 'the """ opened here is never closed')
            body = lines[k]
    if s.startswith('"'):
        first = s.rstrip(" \t")
        if len(first) >= 2 and first.endswith('"'):
            return first[1:-1], i + 1
        for k in range(i + 1, len(lines)):
            line = lines[k].rstrip(" \t")
            if line.endswith('"'):
                return _joined(lines, i, s[1:], k, line[:-1]), k + 1
        fail(i, 'the " opened here is never closed (a quoted value ends at a " that ends a line)')
    return s.strip(), i + 1


def _joined(lines: list[str], i: int, first: str, k: int, last: str) -> str:
    """Text of a value spanning lines i..k: the tail of line i, the whole lines between, the head of line k."""
    return "\n".join([first, *lines[i + 1:k], last])


def _jinja_problem(template: str) -> str | None:
    """Why `template` is no Jinja template, or None (also when jinja2 is not installed: llama.cpp will say)."""
    try:
        import jinja2
        import jinja2.ext
    except ImportError:
        return None

    class Generation(jinja2.ext.Extension):  # HF templates' {% generation %}, which llama-cpp-python accepts
        tags = {"generation"}  # noqa: RUF012 (jinja2's API)

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    try:
        jinja2.Environment(extensions=[jinja2.ext.loopcontrols, Generation]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        hint = ""
        if re.search(r"\{\{-?\s*\.", template):
            hint = ("; this looks like an Ollama Go template ({{ .Prompt }}): zipmoe runs llama.cpp, which takes Jinja "
                    "chat templates such as a GGUF's tokenizer.chat_template ({% for message in messages %}...)")
        return f"not a Jinja chat template: {e.message} (template line {e.lineno}){hint}"
    return None


def parse(text: str, source: str = "Modelfile") -> Modelfile:
    """Reads a Modelfile; ModelfileError names the line of the first problem."""
    lines = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n").split("\n")

    def fail(i: int, message: str) -> Any:
        raise ModelfileError(message, source=source, line=i + 1)

    def keyed(pattern: re.Pattern[str], rest: str, i: int, keys: Any, usage: str, unknown: Any) -> tuple[str, str]:
        """PARAMETER's name or MESSAGE's role (lower case, one of `keys`) and the value's start after it."""
        m = pattern.fullmatch(rest.lstrip(" \t"))
        if m is None or not (m.group(2) or "").strip():
            fail(i, usage)
        if m.group(1).lower() not in keys:
            fail(i, unknown(m.group(1)))
        return m.group(1).lower(), m.group(2)

    from_: str | None = None
    params: dict[str, Any] = {}
    texts: dict[str, str] = {}
    licenses: list[str] = []
    messages: list[Message] = []
    where: dict[str, int] = {}
    warned: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i].lstrip(" \t")
        if not line.strip() or line.startswith("#"):
            i += 1
            continue
        m = _DIRECTIVE.fullmatch(line)
        word = line.split(None, 1)[0]
        directive = word.upper()
        if m is None or directive not in DIRECTIVES:
            if directive in OLLAMA_ONLY:
                fail(i, f"{directive}: {OLLAMA_ONLY[directive]}")
            fail(i, f"unknown directive {word!r}; a Modelfile line starts with one of {', '.join(DIRECTIVES)} "
                    "(or # for a comment)")
        rest = m.group(2) or ""
        start = i
        if directive == "PARAMETER":
            name, raw = keyed(_PARAMETER, rest, i, PARAMETERS,
                              "PARAMETER needs a name and a value, e.g. PARAMETER temperature 0.7",
                              lambda word: f"unknown parameter {word!r}; zipmoe knows {', '.join(PARAMETERS)}")
            raw, i = _read_value(lines, i, raw, fail)
            if old_cache_mode(name, raw):
                warned.append(f"{source}, line {start + 1}: PARAMETER {name} {raw.strip()} is the old spelling of "
                              f"PARAMETER {CACHE_MODE_PARAMETER} {raw.strip().lower()} ({name} is the eviction "
                              f"policy, as --policy); read as {CACHE_MODE_PARAMETER}")
                name = CACHE_MODE_PARAMETER
            try:
                value = parse_parameter(name, raw)
            except ValueError as e:
                fail(start, f"PARAMETER {name} {e}")
            if PARAMETERS[name].repeat:
                params.setdefault(name, []).append(value)
            elif name in params:
                fail(start, f"PARAMETER {name} is already set on line {where[name]}")
            else:
                params[name] = value
            where.setdefault(name, start + 1)
            continue
        if directive == "MESSAGE":
            role, said = keyed(_MESSAGE, rest, i, ROLES, "MESSAGE needs a role and a text, e.g. MESSAGE user Hello",
                               lambda word: f"MESSAGE role {word!r} is not one of {', '.join(ROLES)}")
            content, i = _read_value(lines, i, said, fail)
            messages.append(Message(role, content))
            continue
        if not rest.strip(" \t"):
            fail(i, f"{directive} needs a value")
        value, i = _read_value(lines, i, rest, fail)
        if directive == "LICENSE":
            licenses.append(value)
            where.setdefault("LICENSE", start + 1)
            continue
        if directive in where:
            fail(start, f"{directive} is already given on line {where[directive]}")
        where[directive] = start + 1
        if directive == "FROM":
            if not value:
                fail(start, "FROM needs a value")
            from_ = value
        else:
            if directive == "TEMPLATE" and value.strip():
                problem = _jinja_problem(value)
                if problem:
                    fail(start, f"TEMPLATE is {problem}")
            texts[directive] = value
    if from_ is None:
        raise ModelfileError("no FROM line: a Modelfile starts from a model, e.g. FROM ./model-bf16.gguf",
                             source=source)
    return Modelfile(from_, MappingProxyType(params), texts.get("TEMPLATE"), texts.get("SYSTEM"), tuple(licenses),
                     tuple(messages), source, MappingProxyType(where), tuple(warned))


# ------------------------------------------------------------------------------------------ writing


def quote(value: str) -> str:
    """`value` spelled so that parse() reads it back exactly: bare when that is safe, else quoted."""
    candidates = []
    if value == value.strip() and value and "\n" not in value and not value.startswith('"'):
        candidates.append(value)
    candidates += [f'"""{value}"""', f'"{value}"']
    for c in candidates:
        lines = c.split("\n")
        try:
            got, end = _read_value(lines, 0, lines[0], _raise)
        except ValueError:
            continue
        if got == value and end == len(lines):
            return c
    raise ValueError(f"{value[:40]!r}... cannot be written in a Modelfile (it holds both \"\"\" and a quote at the end "
                     "of a line)")


def _raise(i: int, message: str) -> None:
    raise ValueError(message)


def render(mf: Modelfile, header: Iterable[str] = ()) -> str:
    """The Modelfile text of `mf` (what `zipmoe show --modelfile` prints); parse(render(mf)) == mf."""
    out = [f"# {h}" for h in header]
    if out:
        out.append("")
    out.append(f"FROM {quote(mf.from_)}")
    if mf.template is not None:
        out.append(f"TEMPLATE {quote(mf.template)}")
    if mf.system is not None:
        out.append(f"SYSTEM {quote(mf.system)}")
    for name, value in mf.parameters.items():
        for v in (value if PARAMETERS[name].repeat else [value]):
            out.append(f"PARAMETER {name} {quote(format_parameter(v, name))}")
    for m in mf.messages:
        out.append(f"MESSAGE {m.role} {quote(m.content)}")
    for text in mf.license:
        out.append(f"LICENSE {quote(text)}")
    return "\n".join(out) + "\n"
