"""GGUF tokenizer metadata -> tokenizer.json + tokenizer_config.json (read by hybridmoe.tokenizer).

Byte-level BPE ("gpt2" in tokenizer.ggml.model: Qwen, DeepSeek, Llama-3 style) is rebuilt with the
`tokenizers` library from tokenizer.ggml.tokens / merges / token_type: CONTROL tokens become
special added tokens, USER_DEFINED ones added tokens; the pre-tokenizer split follows
tokenizer.ggml.pre (GPT-2's; Qwen2's; Qwen3.5's, which keeps combining marks in their word; GLM-4's:
Llama-3's split, digits in runs of up to three; or "gpt-4o", gpt-oss's o200k split: words cut before
an upper-case run, contractions kept on the word, digits by three).
As llama.cpp does for GLM-4 vocabularies, a word that is itself a token is not merged up from pieces,
and no BOS is added (GLM's chat template writes its [gMASK]<sop> prefix).

SentencePiece BPE ("llama": Llama/Mistral/Mixtral) is rebuilt as Hugging Face's Llama tokenizer.json
is: a byte-fallback BPE over tokenizer.ggml.tokens whose merges come from tokenizer.ggml.scores.
SentencePiece merges, at each step, the adjacent pair whose concatenation is the highest-scoring
piece; so every split of a piece into two pieces is a merge, ranked by the merged piece's score
(ties by id). Spaces become "▁", with one in front of the text (and after each special token)
unless tokenizer.ggml.add_space_prefix is false; BYTE tokens (<0x41>) spell what the vocabulary lacks.
"""

from __future__ import annotations

import warnings

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from hybridmoe.errors import CheckpointError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
"""tokenizer.ggml.token_type values (llama.cpp's llama_token_type)."""
SPACE = "\u2581"
"""SentencePiece's visible space, "▁"."""

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
"""Qwen3.5's split: Qwen2's, with combining marks (\\p{M}) kept in the word they follow."""
_GLM4_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
"""o200k's split as its tokenizer.json writes it; llama.cpp's "gpt-4o" pre-tokenizer spells the same split with
lookaheads its regex engine runs."""
_SPLITS = {"qwen2": _QWEN2_SPLIT, "qwen35": _QWEN35_SPLIT, "glm4": _GLM4_SPLIT, "glm5": _GLM4_SPLIT,
           "chatglm-bpe": _GLM4_SPLIT, "gpt-4o": _O200K_SPLIT}
"""tokenizer.ggml.pre -> the regex that splits text into words (llama.cpp's llama-vocab.cpp)."""
_GLM = ("glm4", "glm5", "chatglm-bpe")
"""Pre-tokenizer names whose vocabularies llama.cpp runs without a BOS token."""


def _pre_tokenizer(pre: str | None):
    if pre in (None, "default", "gpt-2", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    warnings.warn(f"GGUF tokenizer.ggml.pre {pre!r} is not known here; splitting words as GPT-2 does, "
                  "which may tokenize some text differently from llama.cpp", stacklevel=3)
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a NORMAL piece, the highest-scoring merged piece first."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] not in (CONTROL, BYTE)}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def _spm_tokenizer(meta: dict, tokens: list[str], types: list[int]) -> Tokenizer:
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise CheckpointError(f"GGUF tokenizer has {len(tokens)} tokens but {len(scores)} scores")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else \
        next((t for t, ty in zip(tokens, types) if ty == UNKNOWN), None)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, types), unk_token=unk,
                               byte_fallback=True, fuse_unk=True))
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    escape = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if space_prefix else escape
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return tok


def tokenizer_files(meta: dict) -> tuple[Tokenizer, dict] | None:
    """(tokenizer, tokenizer_config dict) from GGUF metadata; None (with a warning) if it has none we rebuild."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind not in ("gpt2", "llama"):
        warnings.warn(f"GGUF tokenizer model {kind!r} is not rebuilt (only byte-level BPE 'gpt2' and SentencePiece "
                      "BPE 'llama'); this model takes token ids, not text", stacklevel=2)
        return None
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")
    if kind == "llama":
        tok = _spm_tokenizer(meta, tokens, types)
    else:
        merges = meta.get("tokenizer.ggml.merges") or []
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                   merges=[tuple(m.split(" ", 1)) for m in merges],
                                   ignore_merges=meta.get("tokenizer.ggml.pre") in ("glm4", "glm5")))
        tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        tok.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=ty == CONTROL, normalized=False)
             for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
    tok.add_tokens(added)
    vocab = {t: i for i, t in enumerate(tokens)}
    config = {}
    for role, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            config[role] = tokens[int(token_id)]
    if kind == "gpt2" and meta.get("tokenizer.ggml.pre") in _GLM:
        config.pop("bos_token", None)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and "bos_token" in config
    if add_bos:
        bos = config["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, vocab[bos])])
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config["add_bos_token"] = add_bos
    if meta.get("tokenizer.chat_template") is not None:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, config
