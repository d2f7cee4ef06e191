"""JSON as the tool-call formats carry it: strict parsing (no NaN or Infinity), the arguments' canonical compact
text, and a call's name and arguments read out of a parsed value."""

from __future__ import annotations

import json
from typing import Any


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def load_json(text: str) -> tuple[bool, Any]:
    """(True, value) for strict JSON text, else (False, None): NaN and Infinity, which JSON lacks, are refused."""
    try:
        return True, json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return False, None


def compact_json(value: Any) -> str:
    """The one form arguments take: compact JSON, non-ASCII kept as is; \\u escapes only where a lone surrogate
    (which UTF-8 cannot encode) would otherwise reach the answer."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode()
    except UnicodeEncodeError:
        text = json.dumps(value, separators=(",", ":"))
    return text


def call_arguments(value: Any) -> str | None:
    """A call's arguments as compact JSON: an object, or a string holding one (some models quote the arguments);
    None for anything else."""
    if isinstance(value, str):
        ok, value = load_json(value)
        if not ok:
            return None
    if not isinstance(value, dict):
        return None
    try:
        return compact_json(value)
    except (ValueError, RecursionError):
        return None


def arguments_from_text(text: str) -> str | None:
    """Compact JSON of the argument object written as JSON text; None when the text is not one."""
    ok, value = load_json(text)
    return call_arguments(value) if ok else None


def clean_name(value: Any) -> str | None:
    """A function name without surrounding whitespace; None when it is not text, empty, or has whitespace inside
    (prose, not a name)."""
    if not isinstance(value, str):
        return None
    name = value.strip()
    return name if name and not any(c.isspace() for c in name) else None


def json_call(value: Any) -> tuple[str, str] | None:
    """(name, arguments) of a call written as a JSON object {"name": ..., "arguments": {...}} ("parameters" is
    read where "arguments" is missing; neither means no arguments); None when the value is not such a call."""
    if not isinstance(value, dict):
        return None
    name = clean_name(value.get("name"))
    arguments = call_arguments(value["arguments"] if "arguments" in value else value.get("parameters", {}))
    return (name, arguments) if name is not None and arguments is not None else None
