"""EngineConfig's fields as command-line flags, one to one (--max-num-seqs -> max_num_seqs).

Shared by every command that builds an engine (run, chat, serve, bench), so a new EngineConfig
field becomes a flag everywhere at once. Help texts are the fields' docstrings.
"""

from __future__ import annotations

import argparse
import ast
import inspect
from dataclasses import fields

from hybridmoe.config import EngineConfig

_TYPES = {"str": str, "int": int, "float": float, "bool": bool}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options")
    docs = _field_docs()
    for f in fields(EngineConfig):
        kind = _base_type(f.type)
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{docs.get(f.name, '')} (default: {f.default})"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=None, metavar=f.name.upper(), help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options given on the command line, as EngineConfig keyword arguments."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if getattr(args, f.name, None) is not None}


def _base_type(annotation: str) -> type:
    # annotations are strings ("int | None"): the one non-None type names the flag's type
    names = [part.strip() for part in str(annotation).split("|") if part.strip() != "None"]
    return _TYPES.get(names[0], str) if len(names) == 1 else str


def _field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal under it), squeezed onto one line."""
    try:
        tree = ast.parse(inspect.getsource(EngineConfig))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split()).replace("%", "%%")
    return docs
