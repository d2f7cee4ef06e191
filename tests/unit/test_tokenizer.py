import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from hybridmoe.errors import HybridMoEError
from hybridmoe.tokenizer import Tokenizer

# A Qwen-style template that uses what real ones use: loop controls, namespace, tojson,
# raise_exception, trim_blocks/lstrip_blocks-sensitive layout, and special-token variables.
TEMPLATE = """{%- set ns = namespace(n=0) %}
{%- for m in messages %}
    {%- if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
    {%- if m.role == 'system' and not loop.first %}{% continue %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
<|im_start|>{{ m.role }}
{{ m.content }}{% if m.meta is defined %} {{ m.meta | tojson }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}{{ eos_token if ns.n > 99 else '' }}"""

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "héllo, wörld: 你好", "meta": {"k": "ü"}},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "The quick brown fox?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. Hello world!"] * 4,
                            trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                special_tokens=["<s>", "<|im_start|>", "<|im_end|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    d = tmp_path_factory.mktemp("tok")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>")
    hf.chat_template = TEMPLATE
    hf.save_pretrained(d)
    return d


def test_a_directory_without_tokenizer_json_has_no_tokenizer(tmp_path):
    assert Tokenizer.from_dir(tmp_path) is None


def test_encode_and_decode_match_transformers(model_dir):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.from_dir(model_dir)
    text = "Hello world, the lazy fox! 你好"
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.encode(text)[0] == ours.token_to_id("<s>")
    ids = ours.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text
    assert ours.eos_token_id == hf.eos_token_id


def test_chat_template_renders_and_tokenizes_like_transformers(model_dir):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.from_dir(model_dir)
    for add in (True, False):
        text = ours.apply_chat_template(MESSAGES, add_generation_prompt=add)
        assert text == hf.apply_chat_template(MESSAGES, add_generation_prompt=add, tokenize=False)
        assert ours.encode_chat(MESSAGES, add_generation_prompt=add) == list(
            hf.apply_chat_template(MESSAGES, add_generation_prompt=add, tokenize=True, return_dict=False))
    assert text.count("<|im_start|>") == 4 and '{"k": "ü"}' in text


def test_template_from_tokenizer_config_in_the_named_list_form(model_dir, tmp_path):
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    config = {"eos_token": {"content": "<|im_end|>"},
              "chat_template": [{"name": "tool_use", "template": "tools"},
                                {"name": "default", "template": "{{ messages[0].content }}{{ eos_token }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x<|im_end|>"


def test_a_template_that_raises_gives_a_clear_error(model_dir):
    with pytest.raises(HybridMoEError, match="chat template rejected these messages: bad role tool"):
        Tokenizer.from_dir(model_dir).apply_chat_template([{"role": "tool", "content": "x"}])


def test_no_chat_template_is_a_clear_error(model_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    with pytest.raises(HybridMoEError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_malformed_messages_are_a_clear_error(model_dir):
    with pytest.raises(HybridMoEError, match="messages must be"):
        Tokenizer.from_dir(model_dir).apply_chat_template([{"content": "no role"}])
