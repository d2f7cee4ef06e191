"""The reasoning parser splits <think> reasoning from the answer, whether the template opened <think> in the prompt
or the model writes it; a stream cut anywhere assembles to what parse() reads; random text never raises."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.server.reasoning import (
    ReasoningParser,
    prompt_opens_reasoning,
    reasoning_parser,
)
from hybridmoe.server.tool_parsers import Delta
from hybridmoe.server.tool_parsers.base import assemble

CASES = [
    pytest.param(True, "The user asks for the capital.\nIt is Paris.\n</think>\n\nParis is the capital of France.",
                 ("The user asks for the capital.\nIt is Paris.", "Paris is the capital of France."),
                 id="opened-by-the-template"),
    pytest.param(False, "<think>\nShort question; 2 + 2 = 4.\n</think>\n\nThe answer is 4.",
                 ("Short question; 2 + 2 = 4.", "The answer is 4."), id="opened-by-the-model"),
    pytest.param(False, "Just an answer.", (None, "Just an answer."), id="no-reasoning"),
    pytest.param(True, "Still weighing the options: 東京 or Zürich",
                 ("Still weighing the options: 東京 or Zürich", None), id="ran-out-while-thinking"),
    pytest.param(False, "<think>Never closed", ("Never closed", None), id="opened-never-closed"),
    pytest.param(False, "<think>\n\n</think>\n\nHello!", (None, "Hello!"), id="empty-reasoning"),
    pytest.param(True, "<think>\nhmm, again</think>ok", ("hmm, again", "ok"), id="template-and-model-both-open"),
    pytest.param(False, "\n</think>\n\nHi", (None, "Hi"), id="unexpected-close-first"),
    pytest.param(False, "<think>a</think>Close it with </think> and open with <think>.",
                 ("a", "Close it with </think> and open with <think>."), id="markers-in-the-answer"),
    pytest.param(True, "I see a <think> tag in the question.</think>Yes.",
                 ("I see a <think> tag in the question.", "Yes."), id="marker-in-the-reasoning"),
    pytest.param(False, "Reply with <think> tags", (None, "Reply with <think> tags"), id="open-after-text"),
    pytest.param(True, "", (None, None), id="empty"),
]

FRAGMENTS = ["<think>", "</think>", "<th", "</thi", "<", "/", ">", "\n", " ", "  \n", "é", "a", "done."]
RANDOM_TEXT = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=3)), max_size=25).map("".join)


def stream(starts_in_reasoning: bool, pieces: list[str]) -> list[Delta]:
    reader = ReasoningParser(starts_in_reasoning).stream()
    return [d for piece in pieces for d in reader.feed(piece)] + reader.finish()


def streamed(deltas: list[Delta]) -> tuple[str | None, str | None]:
    parsed = assemble(deltas)
    assert not parsed.tool_calls
    return parsed.reasoning, parsed.content


def cut(text: str, points: list[int]) -> list[str]:
    bounds = [0, *sorted(points), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("starts, text, expected", CASES)
def test_parse_splits_reasoning_from_the_answer(starts, text, expected):
    assert ReasoningParser(starts).parse(text) == expected


@pytest.mark.parametrize("starts, text, expected", CASES)
def test_a_stream_fed_one_character_at_a_time_reads_the_same(starts, text, expected):
    assert streamed(stream(starts, list(text))) == expected


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_split_streams_what_parse_reads(data):
    starts, text, expected = data.draw(st.sampled_from([c.values for c in CASES]))
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    assert streamed(stream(starts, cut(text, points))) == expected


@settings(max_examples=400, deadline=None)
@given(starts=st.booleans(), text=RANDOM_TEXT, data=st.data())
def test_random_text_never_raises_and_streams_alike(starts, text, data):
    parsed = ReasoningParser(starts).parse(text)
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    assert streamed(stream(starts, cut(text, points))) == parsed


def test_reasoning_streams_before_the_answer_arrives():
    reader = ReasoningParser(True).stream()
    assert reader.feed("Let me think") == [Delta(reasoning="Let me think")]
    assert reader.feed(" more.\n</th") == [Delta(reasoning=" more.")]
    assert reader.feed("ink>\n\nAnswer") == [Delta(content="Answer")]
    assert reader.finish() == []


def test_a_long_reasoning_fed_a_character_at_a_time_takes_linear_work():
    text = "thinking <th </ \n " * 20_000
    assert streamed(stream(True, list(text))) == (text.strip(), None)


TEMPLATE_QWEN3 = ("{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
                  "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
                  "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}")
TEMPLATE_QWEN3_THINKING = ("{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}"
                           "{%- endif %}\n{%- if add_generation_prompt %}\n"
                           "    {{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}")


TEMPLATE_DEEPSEEK_V31 = ("{% if add_generation_prompt %}{{'<｜Assistant｜>'}}{% if not thinking %}{{'</think>'}}"
                         "{% else %}{{'<think>'}}{% endif %}{% endif %}")


@pytest.mark.parametrize("template, prompt, starts", [
    (TEMPLATE_QWEN3, "<|im_start|>assistant\n", False),
    (TEMPLATE_QWEN3_THINKING, "<|im_start|>assistant\n<think>\n", True),
    (TEMPLATE_DEEPSEEK_V31, "<｜Assistant｜></think>", False),
    (TEMPLATE_DEEPSEEK_V31, "<｜Assistant｜><think>", True),
])
def test_a_template_with_think_gets_a_parser_that_starts_where_the_prompt_leaves_off(template, prompt, starts):
    parser = reasoning_parser(template, prompt)
    assert parser is not None and parser.starts_in_reasoning is starts


@pytest.mark.parametrize("template", [None, "", "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}"])
def test_a_template_without_think_gets_no_reasoning_parser(template):
    assert reasoning_parser(template, "<think>") is None


@pytest.mark.parametrize("prompt, opens", [
    ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("<｜User｜>Hi<｜Assistant｜></think>", False),
    ("<|im_start|>user\nWhat does <think> do?<|im_end|>\n<|im_start|>assistant\n", False),
])
def test_a_rendered_prompt_tells_whether_the_output_starts_in_reasoning(prompt, opens):
    assert prompt_opens_reasoning(prompt) is opens
