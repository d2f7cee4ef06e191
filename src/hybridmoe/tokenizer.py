"""The tokenizer and chat template of a model directory, read without transformers.

tokenizer.json is loaded with the `tokenizers` library. The chat template comes from
chat_template.jinja, chat_template.json or tokenizer_config.json's "chat_template" (in that
order, as transformers saves them) and is rendered with jinja2 in a sandbox, with the same
environment transformers gives it (trim_blocks, lstrip_blocks, loop controls, tojson,
raise_exception, strftime_now) and the special tokens of tokenizer_config.json as variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from hybridmoe.errors import CheckpointError, HybridMoEError

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                       "mask_token")


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict, chat_template: str | None):
        self._tok = tokenizer
        self.config = config
        """tokenizer_config.json as read ({} when absent)."""
        self.chat_template = chat_template
        self.special_tokens = {k: _token_text(config.get(k)) for k in _SPECIAL_TOKEN_KEYS
                               if _token_text(config.get(k)) is not None}
        """Special tokens by role (bos_token, eos_token, ...), as the chat template sees them."""

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer | None":
        """The tokenizer of a model directory, or None when it has no tokenizer.json."""
        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            return None
        try:
            tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{d / 'tokenizer.json'} cannot be read: {e}") from None
        config = _read_json(d / "tokenizer_config.json") or {}
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
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

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
        try:
            return self._compiled_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                **self.special_tokens, **template_kwargs)
        except jinja2.TemplateError as e:
            raise HybridMoEError(f"the chat template rejected these messages: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **template_kwargs) -> list[int]:
        # The template writes BOS itself when the model wants one, so no special tokens here.
        text = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointError(f"the chat template does not parse: {e}") from None


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
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


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
