"""Kimi-K2's tokenizer files for make-model, laid out as the release ships them: tiktoken.model (one base64 token
and its rank a line, no tokenizer.json) and tokenizer_config.json with Kimi's special tokens and chat template.

The ranks are the 256 bytes, then the tokens of the small byte-level BPE every family trains (tokenizer.py), in
the order it made them; Kimi's 256 special ids follow the ranks, the named tokens at their release offsets (the
tool-call markers not special, so decoding keeps them for the tool parser), the rest <|reserved_token_ID|>.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from hybridmoe.checkpoint.tokenizer import TokenizerFamily, build_tokenizer
from hybridmoe.tokenizer_tiktoken import BYTE_CHARS, TIKTOKEN_FILE

RESERVED_SPECIALS = 256
"""Special ids after the ranks (Kimi's num_reserved_special_tokens)."""

SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
            6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
            11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
            14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>", 254: "[UNK]",
            255: "[PAD]"}
"""Offset from the first special id -> Kimi's token there."""

_NOT_SPECIAL = {"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"}

# Kimi's layout: every turn <|im_ROLE|>ROLE<|im_middle|>TEXT<|im_end|> (a tool result is a system turn named tool,
# "## Return of ID" then its text); a default system turn when the conversation has none; tools declared as JSON
# in a tool_declare system turn first; the assistant's calls in a tool-calls section, each
# functions.NAME:INDEX<|tool_call_argument_begin|>ARGUMENTS; the answer opens <|im_assistant|>assistant<|im_middle|>.
_KIMI = (
    "{%- if tools %}{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' }}{%- endif %}"
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_system|>tool<|im_middle|>## Return of ' + (message.get('tool_call_id') or '') + '\\n'"
    " + message['content'] }}"
    "{%- else %}"
    "{{- '<|im_' + message['role'] + '|>' + message['role'] + '<|im_middle|>' + (message['content'] or '') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|tool_calls_section_begin|>' }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set args = call['function']['arguments'] %}"
    "{{- '<|tool_call_begin|>functions.' + call['function']['name'] + ':' + (loop.index0 | string)"
    " + '<|tool_call_argument_begin|>' + (args if args is string else args | tojson) + '<|tool_call_end|>' }}"
    "{%- endfor %}"
    "{{- '<|tool_calls_section_end|>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"
)
CHAT_TEMPLATE = _KIMI

_TRAINER = TokenizerFamily((), bos=None, eos="", pad="", unk=None, extra_eos=(), chat_template="")
"""build_tokenizer's input for the ranks: no special tokens (Kimi's come after the ranks)."""


def kimi_ranks(num_ranks: int) -> dict[bytes, int]:
    """num_ranks tiktoken ranks: the 256 bytes in byte order, then the trained (and filled-up) BPE's tokens in the
    order of their ids, which is the order its merges made them."""
    if num_ranks < 256:
        raise ValueError(f"a byte-level vocabulary needs 256 ranks for the bytes, got {num_ranks}")
    byte_of = {c: b for b, c in enumerate(BYTE_CHARS)}
    vocab = build_tokenizer(_TRAINER, num_ranks).get_vocab()
    ranks = {bytes([b]): b for b in range(256)}
    for text, _ in sorted(vocab.items(), key=lambda item: item[1]):
        token = bytes(byte_of[c] for c in text)
        if token not in ranks and len(ranks) < num_ranks:
            ranks[token] = len(ranks)
    return ranks


def write_kimi_tokenizer(out_dir: Path, vocab_size: int) -> dict:
    """Write tiktoken.model + tokenizer_config.json for a vocabulary of vocab_size ids (ranks, then
    RESERVED_SPECIALS special ids); return the token ids the configs need, as tokenizer.write_tokenizer does."""
    ranks = kimi_ranks(vocab_size - RESERVED_SPECIALS)
    lines = (base64.b64encode(token) + b" " + str(rank).encode() for token, rank in ranks.items())
    (out_dir / TIKTOKEN_FILE).write_bytes(b"\n".join(lines) + b"\n")
    first = len(ranks)
    names = {first + i: SPECIALS.get(i, f"<|reserved_token_{first + i}|>") for i in range(RESERVED_SPECIALS)}
    ids = {name: i for i, name in names.items()}
    tokenizer_config = {
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": name not in _NOT_SPECIAL}
                                 for i, name in names.items()},
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    return {"bos_token_id": ids["[BOS]"], "eos_token_id": ids["[EOS]"], "pad_token_id": ids["[PAD]"],
            "generation_eos": [ids["<|im_end|>"], ids["[EOS]"]]}
