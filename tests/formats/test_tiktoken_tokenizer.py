"""A model directory with a tiktoken.model and no tokenizer.json (Kimi-K2's layout) gets a tokenizer that encodes
and decodes exactly as tiktoken itself with the same ranks, pre-tokenizer regex and special tokens; its special
tokens keep their ids and its chat template renders."""

import base64
import json

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiktoken._educational import bpe_train

from hybridmoe.errors import CheckpointError
from hybridmoe.tokenizer import Tokenizer
from hybridmoe.tokenizer_tiktoken import KIMI_PAT_STR, pat_str_of

CORPUS = """\
The quick brown fox jumps over the lazy dog. Don't stop; we'll see what they've done, I'm sure it's fine.
def encode(self, text: str) -> list[int]:
    return [self.ranks[b] for b in text.encode("utf-8")]  # 1234567890 + 3.14159 == 2024
混合专家模型把每个词元交给少数几个专家。中文English混合 你好，世界！ Привет, мир! Ελληνικά. café naïve
    indented    runs of   spaces\t\ttabs\n\nand blank lines\r\n
"""
# ranks trained by tiktoken's own trainer with GPT-2's split (a regex Python's `regex` runs as tiktoken does)
TRAIN_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_' + message['role'] + '|>' + message['role'] + '<|im_middle|>' + message['content'] + '<|im_end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif -%}"
)
EXAMPLES = [
    "", "Hello world", "Hello, world!", "你好世界", "中文English混合", "1234567890", "3.14159e-10", "don't DON'T I'LL",
    "   leading and trailing   ", "tabs\t\tand\nnewlines\r\n\r\n\n", "def f(x):\n    return x ** 2  # square\n",
    "emoji 😀👍🏽 and ZWJ 👨‍👩‍👧", "combining: e\u0301 a\u0308", "Ελληνικά Привет mixedCASEWords", "\u00a0nbsp\u3000ideographic",
    "a<|im_end|>b", "[BOS]text[EOS]", "<|im_user|>user<|im_middle|>hi<|im_end|>",
]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    """(model dir, tiktoken's own Encoding of it): trained ranks, Kimi's special tokens from the first id past
    the ranks with one id left out between, a chat template in Kimi's format."""
    ranks = bpe_train(CORPUS * 3, 400, TRAIN_PAT, visualise=None)
    d = tmp_path_factory.mktemp("kimi")
    lines = (base64.b64encode(token) + b" " + str(rank).encode() for token, rank in sorted(ranks.items(),
                                                                                          key=lambda x: x[1]))
    (d / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")
    ids = {t: len(ranks) + i + (i >= 4) for i, t in enumerate(SPECIALS)}  # a reserved id left out after 4
    config = {"bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": TEMPLATE, "tokenizer_class":
              "TikTokenTokenizer", "added_tokens_decoder": {str(i): {"content": t, "special": True}
                                                            for t, i in ids.items()}}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d, tiktoken.Encoding("kimi-test", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=ids)


@pytest.fixture(scope="module")
def ours(kimi_dir):
    tok = Tokenizer.from_dir(kimi_dir[0])
    assert tok is not None
    return tok


def check_text(tok: Tokenizer, enc: tiktoken.Encoding, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == enc.encode(text, allowed_special="all"), text
    assert tok.decode(ids, skip_special_tokens=False) == enc.decode(ids) == text


@pytest.mark.parametrize("text", EXAMPLES)
def test_encodes_and_decodes_as_tiktoken(ours, kimi_dir, text):
    check_text(ours, kimi_dir[1], text)


def test_the_corpus_encodes_as_tiktoken(ours, kimi_dir):
    check_text(ours, kimi_dir[1], CORPUS)
    assert len(ours.encode(CORPUS)) < 0.6 * len(CORPUS.encode())  # the trained merges are used


ALPHABET = st.sampled_from(list("aAbBsStTlLdDmMvVrReEzZ'’ _-.,;:!?()[]{}<>|/\\\"#$%&*+=~`@^0123456789\t\n\r\u00a0"
                                "\u3000\u2028\u0085\u00e9\u00df\u0130\u017f\u212a\u0301\u0308中文你好世界汉字ひらがなカタカナ"
                                "한국어ΑαΩωЖжØø😀👍🏽\u200d"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.text(ALPHABET, max_size=60), st.text(max_size=40)))
def test_any_text_encodes_as_tiktoken(ours, kimi_dir, text):
    check_text(ours, kimi_dir[1], text)


def test_special_tokens_keep_their_ids(ours, kimi_dir):
    enc = kimi_dir[1]
    for token in SPECIALS:
        want = enc.encode_single_token(token)
        assert ours.token_to_id(token) == ours.special_token_id(token) == want
        assert ours.encode(token, add_special_tokens=False) == [want]
    assert ours.eos_token_id == enc.encode_single_token("[EOS]")
    assert ours.vocab_size == enc.n_vocab - 1  # the id left out is no token
    ids = ours.encode("hi<|im_end|>", add_special_tokens=False)
    assert ours.decode(ids) == "hi" and ours.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"


def test_chat_template_renders_and_encodes_its_special_tokens(ours, kimi_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "中文 question?"}]
    text = ours.apply_chat_template(messages)
    assert text == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>中文 question?"
                    "<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert ours.encode_chat(messages) == kimi_dir[1].encode(text, allowed_special="all")


def test_the_chat_template_file_wins_over_the_config(kimi_dir, tmp_path):
    for f in kimi_dir[0].iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}<|im_end|>")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "x<|im_end|>"


def test_pat_str_is_read_from_the_tokenization_file_as_a_literal(tmp_path):
    assert pat_str_of(tmp_path) == KIMI_PAT_STR  # no file: Kimi's
    (tmp_path / "tokenization_kimi.py").write_text(
        "import os\nclass TikTokenTokenizer:\n    pat_str = '|'.join(\n        [r'''\\p{N}{1,3}''', r'''\\s+''',]\n    )\n")
    assert pat_str_of(tmp_path) == r"\p{N}{1,3}|\s+"
    (tmp_path / "tokenization_kimi.py").write_text("pat_str = os.environ['X']\n")  # not a literal: never run
    assert pat_str_of(tmp_path) == KIMI_PAT_STR


def test_a_damaged_ranks_file_fails_in_one_line(kimi_dir, tmp_path):
    (tmp_path / "tiktoken.model").write_bytes(b"IQ== 0\nnot-base64! 1\n")
    with pytest.raises(CheckpointError, match="line 2 is not '<base64 token> <rank>'"):
        Tokenizer.from_dir(tmp_path)


def test_a_special_token_on_a_ranks_id_fails(kimi_dir, tmp_path):
    (tmp_path / "tiktoken.model").write_bytes((kimi_dir[0] / "tiktoken.model").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"5": {"content": "[X]"}}}))
    with pytest.raises(CheckpointError, match="special token \\[X\\] has the id of a tiktoken.model token"):
        Tokenizer.from_dir(tmp_path)
