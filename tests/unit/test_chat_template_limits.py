"""A chat template runs sandboxed and bounded: loops, time, output and the size of what one operation makes;
going past a bound, or failing inside the template, is one HybridMoEError line."""

import dataclasses
import json
import shutil

import pytest

from hybridmoe.errors import CheckpointError, HybridMoEError
from hybridmoe.tokenizer import TemplateLimits, Tokenizer

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.fixture
def with_template(tiny_qwen3_fp32, tmp_path):
    shutil.copy(tiny_qwen3_fp32 / "tokenizer.json", tmp_path)

    def make(template) -> Tokenizer:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
        return Tokenizer.from_dir(tmp_path)

    return make


def render_error(tok: Tokenizer, messages=MESSAGES) -> str:
    with pytest.raises(HybridMoEError) as e:
        tok.apply_chat_template(messages)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("template, want", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
     "asked for more than 1000000 range() items in one render"),
    ("{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}", "wrote more than 16777216 characters"),
    ("{{ 'x' * 10**10 }}", "made a repetition of 10000000000 items or characters, more than 16777216"),
    ("{{ [0] * 10**9 }}", "made a repetition of 1000000000 items"),
    ("{{ 2 ** (10**9) }}", "made a power of 125000000 bytes"),
    ("{{ 'x'|center(1000000000) }}", "asked for a width of 1000000000 in the center filter"),
    ("{{ messages|tojson(indent=10**8) }}", "width of 100000000 in the tojson filter"),
    ("{{ 'x'.zfill(10**9) }}", "width of 1000000000 in str.zfill"),
    ("{{ '%1000000000d' % 1 }}", "width of 1000000000 in a %-format"),
    ("{{ '%*d' % (10**9, 1) }}", "'*' width in a %-format"),
    ("{{ '%1000000000d'|format(1) }}", "width of 1000000000 in a %-format"),
    ("{{ '{:>1000000000}'.format(1) }}", "width of 1000000000 in a format string"),
    ("{{ '{:>{w}}'.format(1, w=10**9) }}", "nested width in a format string"),
    ("{% set s = 'x' * 1000000 %}{{ ([s] * 100)|join }}", "made a join of 100000000"),
    ("{% set s = 'x' * 1000000 %}{{ ', '.join([s] * 100) }}", "made a join of 100000200"),
    ("{% set s = 'x' * 1000000 %}{{ s|replace('x', 'xxxxxxxxxxxxxxxxxxxx') }}", "made a replace of 20000000"),
    ("{% set s = 'x' * 1000000 %}{{ s.replace('', 'yyyyyyyyyyyyyyyyyyyy') }}", "made a replace of 21000020"),
])
def test_a_template_past_its_bounds_fails_at_once(with_template, template, want):
    assert want in render_error(with_template(template))


def test_a_template_running_past_its_time_stops(with_template):
    tok = with_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    tok.template_limits = dataclasses.replace(TemplateLimits(), seconds=0)
    assert render_error(tok) == "the chat template ran longer than 0 s"


def test_loops_without_range_or_output_check_the_time(with_template):
    tok = with_template("{% for a in messages %}{% for b in messages %}{% endfor %}{% endfor %}")
    tok.template_limits = dataclasses.replace(TemplateLimits(), seconds=0)
    assert render_error(tok) == "the chat template ran longer than 0 s"


@pytest.mark.parametrize("template, want", [
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "failed on these messages: RecursionError: "),
    ("{{ 1 / 0 }}", "failed on these messages: ZeroDivisionError: division by zero"),
    ("{{ messages[0].content + 1 }}", "failed on these messages: TypeError: "),
    ("{{ raise_exception('no tools here') }}", "rejected these messages: no tools here"),
    ("{{ ''.__class__.__mro__ }}", "rejected these messages: "),
])
def test_an_error_inside_the_template_is_one_line(with_template, template, want):
    assert want in render_error(with_template(template))


def test_a_long_conversation_renders_within_the_bounds(with_template):
    tok = with_template("{% for m in messages %}<|{{ m.role }}|>{{ m.content|trim }}\n{% endfor %}"
                        "{% for i in range(messages|length - 1, -1, -1) %}{% if loop.first %}{{ i }}{% endif %}"
                        "{% endfor %}{{ messages|tojson(indent=2)|length > 0 }}")
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f" turn {i} " * 50} for i in range(2000)]
    text = tok.apply_chat_template(messages)
    assert text.count("<|user|>") == 1000 and text.endswith("1999True")


def test_a_tokenizer_config_that_is_not_an_object(with_template, tmp_path):
    with_template("{{ eos_token }}")
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        Tokenizer.from_dir(tmp_path)
