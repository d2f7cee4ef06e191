"""A tiktoken BPE (a `tiktoken.model` ranks file, as Kimi-K2 ships its tokenizer) as a `tokenizers` tokenizer.

tiktoken.model holds one token a line: its bytes in base64, a space, its rank, which is its id. tiktoken splits
text into pieces with a regex, then encodes a piece that is a token as a whole as that token, any other by
merging again and again the adjacent pair whose concatenation has the lowest rank. In `tokenizers`' terms:
- a byte-level BPE whose vocabulary is the tokens (their bytes as byte-level characters) and whose merges are
  every split of a token into two tokens, in the order of the rank of the token they make; ignore_merges takes a
  piece that is in the vocabulary as it is;
- the pre-tokenizer: the regex, then byte-level without a regex of its own; the byte-level decoder;
- the special tokens of tokenizer_config.json's added_tokens_decoder, at their ids (in the vocabulary too:
  added tokens alone take the ids after the vocabulary's, in order, where Kimi's leave some ids out).

The regex is code in the model's tokenization_*.py (Kimi's TikTokenTokenizer.pat_str): it is read from that
file's source as a literal (a string, or "|".join of a list of strings), never run; a directory without one
takes Kimi's, which Moonshot's models (Kimi-K2, K2-Thinking, K2.5, Moonlight) share.
"""

from __future__ import annotations

import ast
import base64
import binascii
import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from hybridmoe.errors import CheckpointError

TIKTOKEN_FILE = "tiktoken.model"

_KIMI_PAT_PARTS = (
    r"""[\p{Han}]+""",
    (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
     r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""),
    (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
     r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""),
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
KIMI_PAT_STR = "|".join(_KIMI_PAT_PARTS)
"""Kimi's pre-tokenizer regex (tokenization_kimi.py, TikTokenTokenizer.pat_str): Han runs stand alone, letters
(Han excepted) with English contractions, up to three digits, punctuation runs, newlines, spaces."""


def _byte_chars() -> list[str]:
    """Byte b -> the printable character byte-level BPE writes it as (GPT-2's table): printable Latin-1 bytes
    as themselves, the other 68 as the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = [""] * 256, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(0x100 + extra)
            extra += 1
    return chars


BYTE_CHARS = _byte_chars()
"""Byte b -> its byte-level character."""


def read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken.model -> {token bytes: rank}."""
    ranks = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise CheckpointError(f"{path} line {number} is not '<base64 token> <rank>'") from None
    if len(set(ranks.values())) != len(ranks):
        raise CheckpointError(f"{path} gives two tokens the same rank")
    return ranks


def _merges(ranks: dict[bytes, int], text: dict[bytes, str]) -> list[list[str]]:
    """Every split of a token into two tokens, the lowest rank of the token they make first (ties: the lower
    ranks of the two parts first)."""
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text[left], text[right]))
    merges.sort()
    return [[left, right] for *_, left, right in merges]


def pat_str_of(model_dir: Path) -> str:
    """The pre-tokenizer regex that model_dir's tokenization_*.py assigns to pat_str, read as a literal; Kimi's
    when there is no such file or assignment."""
    for source in sorted(model_dir.glob("tokenization_*.py")):
        try:
            tree = ast.parse(source.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pat_str"
                                                     for t in node.targets)):
                pattern = _literal_pattern(node.value)
                if pattern is not None:
                    return pattern
    return KIMI_PAT_STR


def _literal_pattern(node: ast.expr) -> str | None:
    """A string literal, or "sep".join([string literals]); None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], (ast.List, ast.Tuple))):
        parts = node.args[0].elts
        if all(isinstance(p, ast.Constant) and isinstance(p.value, str) for p in parts):
            return node.func.value.value.join(p.value for p in parts)
    return None


def _special_tokens(config: dict, path: Path) -> list[dict]:
    """tokenizer_config.json's added_tokens_decoder as tokenizer.json's added_tokens."""
    added = []
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        if not (key.isdigit() and isinstance(entry, dict) and isinstance(entry.get("content"), str)):
            raise CheckpointError(f"{path}: added_tokens_decoder entry {key!r} is not an id with a token's content")
        added.append({"id": int(key), "content": entry["content"], "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": bool(entry.get("special", True))})
    return sorted(added, key=lambda t: t["id"])


def tiktoken_tokenizer(model_dir: Path, config: dict) -> HFTokenizer:
    """The `tokenizers` tokenizer of model_dir's tiktoken.model, its pat_str and config's special tokens."""
    path = model_dir / TIKTOKEN_FILE
    ranks = read_ranks(path)
    text = {token: "".join(BYTE_CHARS[b] for b in token) for token in ranks}
    specials = _special_tokens(config, model_dir / "tokenizer_config.json")
    taken = [t["content"] for t in specials if t["id"] in ranks.values()]
    if taken:
        raise CheckpointError(f"special token {taken[0]} has the id of a {TIKTOKEN_FILE} token")
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": specials, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pat_str_of(model_dir)}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {**{text[token]: rank for token, rank in ranks.items()},
                            **{t["content"]: t["id"] for t in specials}},
                  "merges": _merges(ranks, text)},
    }
    try:
        return HFTokenizer.from_str(json.dumps(spec))
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception: a bad regex, say)
        raise CheckpointError(f"{path} does not make a tokenizer: {e}") from None
