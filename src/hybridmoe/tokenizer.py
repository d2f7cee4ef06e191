"""The tokenizer and chat template of a model directory, read without transformers.

tokenizer.json is loaded with the `tokenizers` library; a directory with a tiktoken.model instead (Kimi-K2)
gets the same tokenizer built from it (tokenizer_tiktoken.py). The chat template comes from
chat_template.jinja, chat_template.json or tokenizer_config.json's "chat_template" (in that
order, as transformers saves them) and is rendered with jinja2 in a sandbox, with the same
environment transformers gives it (trim_blocks, lstrip_blocks, loop controls, tojson,
raise_exception, strftime_now) and the special tokens of tokenizer_config.json as variables.

A template comes with the model and runs as code, so each render is bounded (TemplateLimits): its time,
checked at every loop step, call, attribute or item access and output chunk; the items of all its range()
calls together; the size of its output and of every value one operation makes, checked before the
operations that multiply sizes (*, **, join, replace, padding widths in filters, str methods and format
strings) allocate. Going past a bound, or any error inside the template, is one HybridMoEError line.
"""

from __future__ import annotations

import functools
import json
import math
import re
import string
import time
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from hybridmoe.errors import CheckpointError, HybridMoEError
from hybridmoe.tokenizer_tiktoken import TIKTOKEN_FILE, tiktoken_tokenizer

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                       "mask_token")


@dataclass(frozen=True)
class TemplateLimits:
    """Bounds on one render of a chat template."""

    seconds: float = 2.0
    """Wall time of one render (real templates take milliseconds)."""
    range_items: int = 1_000_000
    """Items of all of a render's range() calls together: nested loops multiply."""
    chars: int = 16 << 20
    """Characters of the output, and items or characters of any one value the template makes."""
    width: int = 100_000
    """Widths given to padding filters and str methods (center, indent, zfill, ...) and in format strings."""


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict, chat_template: str | None):
        self._tok = tokenizer
        self.config = config
        """tokenizer_config.json as read ({} when absent)."""
        self.chat_template = chat_template
        self.special_tokens = {k: _token_text(config.get(k)) for k in _SPECIAL_TOKEN_KEYS
                               if _token_text(config.get(k)) is not None}
        """Special tokens by role (bos_token, eos_token, ...), as the chat template sees them."""
        self.template_limits = TemplateLimits()
        self._special_ids: dict[str, int] | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer | None":
        """The tokenizer of a model directory (tokenizer.json, else a tiktoken.model: tokenizer_tiktoken.py), or
        None when it has neither."""
        d = Path(model_dir)
        config = _read_json(d / "tokenizer_config.json") or {}
        if (d / "tokenizer.json").is_file():
            try:
                tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
            except Exception as e:  # tokenizers raises a bare Exception on malformed files
                raise CheckpointError(f"{d / 'tokenizer.json'} cannot be read: {e}") from None
        elif (d / TIKTOKEN_FILE).is_file():
            tok = tiktoken_tokenizer(d, config)
        else:
            return None
        return cls(tok, config, _find_chat_template(d, config))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it): the server tokenizes on a thread of its
        # own while the event loop answers other requests
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def special_token_id(self, text: str) -> int | None:
        """The id of text when the vocabulary holds it as one special token (which a grammar must name as a
        token: the special token's text is not its bytes), else None."""
        if self._special_ids is None:
            self._special_ids = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        return self._special_ids.get(text)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what a grammar engine builds its token trie from)."""
        return self._tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> str:
        """The conversation as the model expects it, as text (special tokens included)."""
        if self.chat_template is None:
            raise HybridMoEError("this model's tokenizer has no chat template; use a plain prompt "
                                 "(generate) or a model directory with a chat_template")
        if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise HybridMoEError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        budget = _Budget(self.template_limits)
        token = _BUDGET.set(budget)
        try:
            parts = []
            for chunk in self._compiled_template.generate(
                    messages=messages, add_generation_prompt=add_generation_prompt,
                    **self.special_tokens, **template_kwargs):
                budget.add_output(len(chunk))
                parts.append(chunk)
            return "".join(parts)
        except HybridMoEError:
            raise
        except jinja2.TemplateError as e:
            raise HybridMoEError(f"the chat template rejected these messages: {_one_line(e)}") from None
        except Exception as e:  # the template is code that came with the model: any error of its is the template's
            raise HybridMoEError(f"the chat template failed on these messages: {type(e).__name__}: "
                                 f"{_one_line(e)}") from None
        finally:
            _BUDGET.reset(token)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **template_kwargs) -> list[int]:
        # The template writes BOS itself when the model wants one, so no special tokens here.
        text = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
        env.filters[_EACH] = _each
        env.globals["range"] = _range
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            tree = env.parse(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointError(f"the chat template does not parse: {_one_line(e)}") from None
        for loop in list(tree.find_all(jinja2.nodes.For)):  # every loop steps through _each, which checks the time
            loop.iter = jinja2.nodes.Filter(loop.iter, _EACH, [], [], None, None, lineno=loop.lineno)
        return env.from_string(tree)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


_BUDGET: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


class _Budget:
    """What is left of one render's TemplateLimits."""

    def __init__(self, limits: TemplateLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.range_items = limits.range_items
        self.output = limits.chars

    def tick(self) -> None:
        if time.monotonic() >= self.deadline:
            raise HybridMoEError(f"the chat template ran longer than {self.limits.seconds:g} s")

    def take_range(self, n: int) -> None:
        self.range_items -= n
        if self.range_items < 0:
            raise HybridMoEError(f"the chat template's loops asked for more than {self.limits.range_items} range() "
                                 "items in one render")

    def add_output(self, n: int) -> None:
        self.tick()
        self.output -= n
        if self.output < 0:
            raise HybridMoEError(f"the chat template wrote more than {self.limits.chars} characters")

    def check_size(self, n: int, what: str = "a value", unit: str = "items or characters") -> None:
        if n > self.limits.chars:
            raise HybridMoEError(f"the chat template made {what} of {n} {unit}, more than {self.limits.chars}")

    def check_width(self, value, what: str) -> None:
        n = value if type(value) is int else len(value) if isinstance(value, str) else 0
        if n > self.limits.width:
            raise HybridMoEError(f"the chat template asked for a width of {n} in {what}, more than "
                                 f"{self.limits.width}")

    def sized(self, value):
        if isinstance(value, (str, list, tuple, dict)):
            self.check_size(len(value))
        return value


def _budget() -> _Budget:
    """The render's budget; outside a render (constant folding while the template compiles), a fresh one."""
    return _BUDGET.get() or _Budget(TemplateLimits())


_EACH = "hybridmoe_each"


def _each(iterable):
    """A for loop's items, with the time checked at each step."""
    budget = _budget()
    for item in iterable:
        budget.tick()
        yield item


def _range(*args) -> range:
    try:
        r = range(*args)
        n = len(r)
    except (TypeError, ValueError, OverflowError) as e:  # not integers, a zero step, past a C integer
        raise jinja2.TemplateError(f"range{args}: {e}") from None
    _budget().take_range(n)
    return r


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_percent_format(budget: _Budget, fmt: str) -> None:
    for spec in _PERCENT_SPEC.finditer(fmt):
        for width in spec.groups():
            if width == "*":
                raise HybridMoEError("the chat template gave a '*' width in a %-format")
            if width:
                budget.check_width(int(width), "a %-format")


def _check_brace_format(budget: _Budget, fmt: str) -> None:
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec and "{" in spec:
            raise HybridMoEError("the chat template gave a nested width in a format string")
        for width in re.findall(r"\d+", spec or ""):
            budget.check_width(int(width), "a format string")


def _check_expansion(budget: _Budget, op: str, value, args: tuple) -> None:
    """Size the result of join and replace (filters or str methods) before making it."""
    if op == "join" and isinstance(value, (list, tuple)):
        sep = args[0] if args and isinstance(args[0], str) else ""
        budget.check_size(sum(len(v) for v in value if isinstance(v, str)) + len(sep) * len(value), "a join")
    elif op == "replace" and isinstance(value, str) and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        old, new = args[:2]
        times = value.count(old) if old else len(value) + 1
        if len(args) > 2 and type(args[2]) is int and args[2] >= 0:
            times = min(times, args[2])
        budget.check_size(len(value) + times * (len(new) - len(old)), "a replace")


_WIDTH_FILTERS = {"center", "indent", "truncate", "wordwrap", "batch", "slice", "tojson"}
_WIDTH_STR_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs"}


def _bounded_filter(name: str, f):
    """f, with the time checked, the widths it is given bounded and the size of what it makes."""
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # the context jinja passes first

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        budget = _budget()
        budget.tick()
        value, rest = args[skip], args[skip + 1:]
        if name in _WIDTH_FILTERS:
            for a in (*rest, *kwargs.values()):
                budget.check_width(a, f"the {name} filter")
        if name == "format" and isinstance(value, str):
            _check_percent_format(budget, value)
        sep = kwargs.get("d", rest[0] if rest else "")
        _check_expansion(budget, name, value, (sep,) if name == "join" else rest)
        return budget.sized(f(*args, **kwargs))

    return bounded


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox transformers renders with, every operation checked against the render's budget."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context, operator, left, right):
        budget = _budget()
        budget.tick()
        if operator == "*":
            seq, n = (left, right) if type(right) is int else (right, left)
            if isinstance(seq, (str, list, tuple)) and type(n) is int:
                budget.check_size(len(seq) * n, "a repetition")
        elif operator == "**" and type(left) is int and type(right) is int and right > 0 and abs(left) > 1:
            budget.check_size(int(right * math.log2(abs(left))) // 8, "a power", "bytes")
        elif operator == "%" and isinstance(left, str):
            _check_percent_format(budget, left)
        return budget.sized(super().call_binop(context, operator, left, right))

    def call(self, context, obj, /, *args, **kwargs):
        budget = _budget()
        budget.tick()
        owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
        if isinstance(owner, str):
            if name in _WIDTH_STR_METHODS:
                for a in (*args, *kwargs.values()):
                    budget.check_width(a, f"str.{name}")
            _check_expansion(budget, name, args[0] if name == "join" and args else owner,
                             (owner,) if name == "join" else args)
        return budget.sized(super().call(context, obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _budget().tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value):
        owner = getattr(value, "__self__", None)
        if isinstance(owner, str) and getattr(value, "__name__", "") in ("format", "format_map"):
            _check_brace_format(_budget(), owner)
        return super().wrap_str_format(value)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters, which chat templates must not do
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _token_text(entry) -> str | None:
    # tokenizer_config.json holds special tokens as strings or as AddedToken dicts
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return value


def _find_chat_template(d: Path, config: dict) -> str | None:
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    template = (_read_json(d / "chat_template.json") or {}).get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
