"""A SentencePiece vocabulary in GGUF metadata (tokenizer.ggml.model "llama": Llama, Mistral, Mixtral) comes back
as a tokenizer that encodes as SentencePiece's BPE does (spm_encode below, the algorithm llama.cpp runs) and
decodes back to the text."""

import gguf
import numpy as np
import pytest
from gguf_writer import spm_tokenizer_metadata
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from hybridmoe.tokenizer import Tokenizer
from hybridmoe.weights.gguf_file import GGUFFiles
from hybridmoe.weights.gguf_tokenizer import (
    BYTE,
    CONTROL,
    NORMAL,
    SPACE,
    UNKNOWN,
    tokenizer_files,
)

CORPUS = ["The quick brown fox jumps over the lazy dog.", "A mixture of experts routes each token to a few experts.",
          "What is the capital of France? The capital of France is Paris.", "Numbers: 0 1 2 3 10 100 2024.",
          "[INST] Tell me a joke. [/INST] Why did the scarecrow win an award?"] * 20
TEXTS = ["The capital of France is Paris.", "  two spaces, tabs\tand\nnewlines  ", "Zürich → 東京 🚀", "expertsexperts",
         "Parisian foxes quickly recapitalize the jokester's awardwinning scarecrows", "thethethe capitalcapital",
         "[INST] joke [/INST]", "a", ""]
TEMPLATE = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
SPECIALS = ["<unk>", "<s>", "</s>"]


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """Llama's layout: <unk>, <s>, </s>, the 256 byte tokens, then the pieces.

    The pieces' scores are shuffled (a real model scores them by merge order): SentencePiece's BPE is defined for
    any scores, and shuffled ones make the merge order decide far more of each encoding.
    """
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=420, show_progress=False))
    pieces = [p for p, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in np.random.default_rng(0).permutation(len(pieces))]
    return tokens, scores, types


def spm_encode(text: str, tokens: list[str], scores: list[float]) -> list[int]:
    """SentencePiece BPE: from characters, merge the adjacent pair making the best-scoring piece (leftmost on ties);
    a character the vocabulary lacks becomes its UTF-8 bytes."""
    ids = {t: i for i, t in enumerate(tokens)}
    symbols = list((" " + text).replace(" ", SPACE)) if text else []
    while True:
        best = None
        for i in range(len(symbols) - 1):
            merged = symbols[i] + symbols[i + 1]
            if merged in ids and ids[merged] > 258 and (best is None or scores[ids[merged]] > scores[ids[best[1]]]):
                best = (i, merged)
        if best is None:
            break
        symbols[best[0]:best[0] + 2] = [best[1]]
    out = []
    for s in symbols:
        out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()]
    return out


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    tokens, scores, types = spm_vocab()
    path = tmp_path_factory.mktemp("spm") / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    spm_tokenizer_metadata(w, tokens, scores, types, TEMPLATE)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok, config = tokenizer_files(GGUFFiles(path).metadata)
    return Tokenizer(tok, config, config.get("chat_template")), tokens, scores


@pytest.mark.parametrize("text", TEXTS)
def test_spm_gguf_tokenizer_encodes_as_sentencepiece_and_decodes_back(rebuilt, text):
    tok, tokens, scores = rebuilt
    want = spm_encode(text, tokens, scores)
    assert tok.encode(text) == [1] + want
    assert tok.encode(text, add_special_tokens=False) == want
    assert tok.decode([1] + want) == text


def test_spm_gguf_tokenizer_keeps_special_tokens_and_template(rebuilt):
    tok, tokens, scores = rebuilt
    assert tok.eos_token_id == 2 and tok.vocab_size == len(tokens)
    ids = tok.encode_chat([{"role": "user", "content": "Tell me a joke."}])
    assert ids == [1] + spm_encode("[INST] Tell me a joke. [/INST]", tokens, scores)
    assert tok.decode([1, *spm_encode("hi", tokens, scores), 2], skip_special_tokens=False) == "<s> hi</s>"
