"""The tool-call parsers read each format's canned outputs into content, calls and reasoning; a stream of the same
output cut anywhere assembles to what parse() reads; malformed, cut-off and random text never raises and stays
content; and the work stays linear in the output's length."""

import itertools
import json
import re
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridmoe.server.tool_parsers import PARSERS, Delta, ParsedOutput, parser_for_template
from hybridmoe.server.tool_parsers.base import assemble
from hybridmoe.server.tool_parsers.scanning import MarkerScanner, Piece

DS_SECTION, DS_SECTION_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KIMI_SECTION, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_CALL_END, KIMI_ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"


def args(value: dict) -> str:
    """The canonical arguments text: compact JSON, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def hermes(name: str, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def case(parser, text, content=None, calls=(), reasoning=None, id=None):
    return pytest.param(parser, text, (content, reasoning, list(calls)), id=f"{parser}-{id}")


CODE = {"code": "print('</tool_call>')\nx = {\"a\": [1, 2]}",
        "options": {"env": {"DEBUG": True}, "paths": ["a", "b\"c"]}}
HERMES_TWO = ("I'll check the weather in both cities.\n" + hermes("get_weather", {"city": "Paris", "unit": "celsius"})
              + "\n" + hermes("get_weather", {"city": "東京", "unit": "celsius"}))
DS_V3 = ("Let me look that up." + DS_SECTION + DS_CALL + "function" + DS_SEP + "get_weather\n```json\n"
         '{"city": "Paris"}\n```' + DS_CALL_END + "\n" + DS_CALL + "function" + DS_SEP + "get_time\n```json\n"
         '{"timezone": "Europe/Paris", "format": {"h24": true, "fields": ["h", "m"]}}\n```' + DS_CALL_END
         + DS_SECTION_END)
DS_BAD_CALL = DS_CALL + "function" + DS_SEP + 'get_weather\n```json\n{"city": Paris}\n```' + DS_CALL_END
DS_CUT = DS_CALL + "function" + DS_SEP + 'get_weather\n```json\n{"city": "Par'
KIMI_TWO = ("I'll search for both." + KIMI_SECTION + KIMI_CALL + "functions.search:0" + KIMI_ARGS
            + '{"query": "Kimi K2"}' + KIMI_CALL_END + KIMI_CALL + "functions.get_weather:1" + KIMI_ARGS
            + '{"city": "北京", "days": 3}' + KIMI_CALL_END + KIMI_SECTION_END)
GLM_TWO = ("Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n"
           "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>options</arg_key>\n"
           '<arg_value>{"unit": "celsius", "hourly": [6, 12]}</arg_value>\n</tool_call>\n'
           "<tool_call>get_time\n</tool_call>")
MINIMAX_TWO = ('Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">北京</parameter>\n'
               '<parameter name="days">3</parameter>\n<parameter name="options">{"unit": "celsius", "hourly": [6]}'
               '</parameter>\n</invoke>\n<invoke name=get_time>\n</invoke>\n</minimax:tool_call>')
HARMONY_CALL = ("<|channel|>analysis<|message|>The user wants the weather in SF. I should call get_weather.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"location":"San Francisco, CA","unit":"celsius"}<|call|>')
HARMONY_BAD_CALL = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": Paris}'
                    "<|call|>")
HARMONY_OTHER_RECIPIENT = ('<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"query": "x"}'
                           "<|call|>")

CASES = [
    case("hermes", HERMES_TWO, "I'll check the weather in both cities.\n\n",
         [("get_weather", args({"city": "Paris", "unit": "celsius"})),
          ("get_weather", args({"city": "東京", "unit": "celsius"}))], id="two-calls-after-text"),
    case("hermes", hermes("run_python", CODE), None, [("run_python", args(CODE))], id="end-marker-in-string"),
    case("hermes", "The capital of France is Paris.", "The capital of France is Paris.", id="text-only"),
    case("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>', None,
         [("f", args({"x": 1}))], id="quoted-arguments"),
    case("hermes", hermes("get_time", {}) + "\nDone.", "\nDone.", [("get_time", "{}")], id="text-after-call"),
    case("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
         'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', id="malformed"),
    case("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',
         '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>', id="nan-is-not-json"),
    case("hermes", '<tool_call>\n{"name": "search", "arguments": {"query": "hybrid MoE',
         '<tool_call>\n{"name": "search", "arguments": {"query": "hybrid MoE', id="unterminated"),
    case("hermes", '<tool_call>\n{"name": "a", "arguments": {}\n' + hermes("b", {"k": [1, 2, {"n": None}]}),
         '<tool_call>\n{"name": "a", "arguments": {}\n', [("b", args({"k": [1, 2, {"n": None}]}))],
         id="unclosed-then-valid"),
    case("hermes", '<tool_call>\n{"name": "two words", "arguments": {}}\n</tool_call>',
         '<tool_call>\n{"name": "two words", "arguments": {}}\n</tool_call>', id="prose-name"),

    case("deepseek_v3", DS_V3, "Let me look that up.\n",
         [("get_weather", args({"city": "Paris"})),
          ("get_time", args({"timezone": "Europe/Paris", "format": {"h24": True, "fields": ["h", "m"]}}))], id="v3"),
    case("deepseek_v3", DS_SECTION + DS_CALL + "search" + DS_SEP + '{"query": "DeepSeek ' + DS_CALL_END + ' 论文"}'
         + DS_CALL_END + DS_SECTION_END, None, [("search", args({"query": "DeepSeek " + DS_CALL_END + " 论文"}))],
         id="v3.1-end-marker-in-string"),
    case("deepseek_v3", "OK." + DS_SECTION + DS_BAD_CALL + DS_SECTION_END, "OK." + DS_BAD_CALL, id="malformed"),
    case("deepseek_v3", "Checking." + DS_SECTION + DS_CUT, "Checking." + DS_CUT, id="unterminated"),

    case("kimi_k2", KIMI_TWO, "I'll search for both.",
         [("search", args({"query": "Kimi K2"})), ("get_weather", args({"city": "北京", "days": 3}))], id="two-calls"),
    case("kimi_k2", KIMI_SECTION + KIMI_CALL + "functions.echo:0" + KIMI_ARGS + '{"text": "' + KIMI_CALL_END + '"}'
         + KIMI_CALL_END + KIMI_SECTION_END, None, [("echo", args({"text": KIMI_CALL_END}))],
         id="end-marker-in-string"),
    case("kimi_k2", KIMI_SECTION + KIMI_CALL + 'functions.echo:0{"text": "hi"}' + KIMI_CALL_END + KIMI_SECTION_END,
         KIMI_CALL + 'functions.echo:0{"text": "hi"}' + KIMI_CALL_END, id="no-argument-marker"),
    case("kimi_k2", KIMI_SECTION + KIMI_CALL + "functions.echo:0" + KIMI_ARGS + '{"text": [1, 2',
         KIMI_CALL + "functions.echo:0" + KIMI_ARGS + '{"text": [1, 2', id="unterminated"),

    case("glm45", GLM_TWO, "Let me check.\n\n",
         [("get_weather", args({"city": "北京", "days": 3, "options": {"unit": "celsius", "hourly": [6, 12]}})),
          ("get_time", "{}")], id="two-calls"),
    case("glm45", '<tool_call>run_shell\n<arg_key>command</arg_key>\n<arg_value>echo "</tool_call>" > out.txt'
         "</arg_value>\n</tool_call>", None, [("run_shell", args({"command": 'echo "</tool_call>" > out.txt'}))],
         id="end-marker-in-value"),
    case("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>",
         "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>", id="malformed"),
    case("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", id="unterminated"),

    case("minimax_m2", MINIMAX_TWO, "Checking.\n\n\n\n",
         [("get_weather", args({"city": "北京", "days": 3, "options": {"unit": "celsius", "hourly": [6]}})),
          ("get_time", "{}")], id="two-calls"),
    case("minimax_m2", '<minimax:tool_call>\n<invoke name="run_shell">\n<parameter name="command">\necho "</invoke>"'
         ' > out.txt\n</parameter>\n</invoke>\n</minimax:tool_call>', None,
         [("run_shell", args({"command": 'echo "</invoke>" > out.txt'}))], id="end-marker-in-value"),
    case("minimax_m2", '<invoke name="get_weather">\ncity: Paris\n</invoke>',
         '<invoke name="get_weather">\ncity: Paris\n</invoke>', id="malformed"),
    case("minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Par',
         '\n<invoke name="get_weather">\n<parameter name="city">Par', id="unterminated"),

    case("harmony", HARMONY_CALL, None, [("get_weather", args({"location": "San Francisco, CA", "unit": "celsius"}))],
         "The user wants the weather in SF. I should call get_weather.", id="analysis-then-call"),
    case("harmony", "<|channel|>analysis<|message|>A greeting.<|end|><|start|>assistant<|channel|>final<|message|>"
         "Hello! How can I help?<|return|>", "Hello! How can I help?", [], "A greeting.", id="final-answer"),
    case("harmony", "<|channel|>analysis<|message|>Need the order.<|end|><|start|>assistant to=functions.lookup_order"
         '<|channel|>commentary json<|message|>{"order_id": 1234, "fields": ["status", "eta"]}', None,
         [("lookup_order", args({"order_id": 1234, "fields": ["status", "eta"]}))], "Need the order.",
         id="recipient-first-stop-token-cut"),
    case("harmony", "<|channel|>commentary<|message|>Checking both cities now.<|end|><|start|>assistant"
         '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Zürich"}<|call|>',
         "Checking both cities now.", [("get_weather", args({"city": "Zürich"}))], id="preamble"),
    case("harmony", '<|channel|>commentary to=functions.echo <|constrain|>json<|message|>{"text": "<|call|> is'
         ' a marker"}<|call|>', None, [("echo", args({"text": "<|call|> is a marker"}))], id="end-marker-in-string"),
    case("harmony", HARMONY_BAD_CALL, HARMONY_BAD_CALL, id="malformed"),
    case("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par',
         '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par', id="cut-off"),
    case("harmony", "<|channel|>analysis<|message|>Thinking<|end|><|start|>assistant<|channel|>comm",
         "<|start|>assistant<|channel|>comm", [], "Thinking", id="header-cut-off"),
    case("harmony", "<|channel|>analysis<|message|>Search.<|end|>" + HARMONY_OTHER_RECIPIENT,
         HARMONY_OTHER_RECIPIENT, [], "Search.", id="other-recipient"),
    case("harmony", "Hello there.", "Hello there.", id="no-markers"),

    case("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
         '"arguments": {"tz": "Europe/Paris"}}]', None,
         [("get_weather", args({"city": "Paris"})), ("get_time", args({"tz": "Europe/Paris"}))], id="json-list"),
    case("mistral", 'Sure, checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "note": "[TOOL_CALLS] {"}'
         "[TOOL_CALLS]get_time[ARGS]{}", "Sure, checking.",
         [("get_weather", args({"city": "Paris", "note": "[TOOL_CALLS] {"})), ("get_time", "{}")], id="v11-two-calls"),
    case("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Zürich"}', None,
         [("get_weather", args({"city": "Zürich"}))], id="call-id"),
    case("mistral", '[TOOL_CALLS]f[ARGS]{"a": [1, {"b": "]}"}]} trailing', " trailing",
         [("f", args({"a": [1, {"b": "]}"}]}))], id="text-after-call"),
    case("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": 3}]',
         '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": 3}]', id="malformed-list"),
    case("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
         id="unterminated"),
    case("mistral", "[TOOL_CALLS] I cannot call tools for that.", "[TOOL_CALLS] I cannot call tools for that.",
         id="not-a-call"),
]

MARKERS = [
    "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    DS_SECTION, DS_SECTION_END, DS_CALL, DS_CALL_END, DS_SEP, KIMI_SECTION, KIMI_SECTION_END, KIMI_CALL,
    KIMI_CALL_END, KIMI_ARGS, "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>",
    "<|return|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<minimax:tool_call>", "</minimax:tool_call>",
    "<invoke name=", "</invoke>", "<parameter name=", "</parameter>",
]
FRAGMENTS = MARKERS + [m[:k] for m in MARKERS for k in (1, 3, len(m) - 1)] + [
    '{"name": "f", "arguments": {"a": 1}}', '[{"name": "g", "arguments": {}}]', '"', "\\", "{", "}", "[", "]", ":",
    ",", "\n", " ", "functions.f:0", "function", "```json\n", "```", "analysis", "final", "commentary",
    " to=functions.f", "json", "NaN", "é", "東京", '{"x": "', "\\u00e9", "\\ud800", "f", '{"a": [1, "]"]}',
    *(c.values[1] for c in CASES),
]
RANDOM_TEXT = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=30).map("".join)


def summary(parsed: ParsedOutput):
    return parsed.content, parsed.reasoning, [(call.name, call.arguments) for call in parsed.tool_calls]


def stream_deltas(parser_name: str, pieces: list[str]) -> list[Delta]:
    reader = PARSERS[parser_name]().stream()
    deltas = [d for piece in pieces for d in reader.feed(piece)]
    return deltas + reader.finish()


def cut(text: str, points: list[int]) -> list[str]:
    bounds = [0, *sorted(points), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def check_call_deltas(deltas: list[Delta]) -> None:
    """Each call opens with one delta holding its index (in order from 0), id and name; later ones have neither."""
    seen = []
    for delta in deltas:
        if delta.index is None:
            assert delta.id is None and delta.name is None and delta.arguments is None
        elif delta.index not in seen:
            assert delta.index == len(seen)
            assert re.fullmatch(r"call_[A-Za-z0-9]{24}", delta.id) and delta.name
            seen.append(delta.index)
        else:
            assert delta.id is None and delta.name is None


@pytest.mark.parametrize("parser_name, text, expected", CASES)
def test_parse_reads_the_canned_output(parser_name, text, expected):
    assert summary(PARSERS[parser_name]().parse(text)) == expected


@pytest.mark.parametrize("parser_name, text, expected", CASES)
def test_a_stream_fed_one_character_at_a_time_reads_the_same(parser_name, text, expected):
    deltas = stream_deltas(parser_name, list(text))
    check_call_deltas(deltas)
    assert summary(assemble(deltas)) == expected


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_any_split_streams_what_parse_reads(data):
    parser_name, text, expected = data.draw(st.sampled_from([c.values for c in CASES]))
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    deltas = stream_deltas(parser_name, cut(text, points))
    check_call_deltas(deltas)
    assert summary(assemble(deltas)) == expected


@pytest.mark.parametrize("parser_name", sorted(PARSERS))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_text_never_raises_and_streams_alike(parser_name, data):
    text = data.draw(RANDOM_TEXT)
    parsed = PARSERS[parser_name]().parse(text)
    for call in parsed.tool_calls:
        assert isinstance(json.loads(call.arguments), dict) and call.name
        call.arguments.encode()
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    deltas = stream_deltas(parser_name, cut(text, points))
    check_call_deltas(deltas)
    assert summary(assemble(deltas)) == summary(parsed)


def joined(pieces: list[Piece]) -> list[Piece]:
    """Pieces with each run of plain text as one piece (how a split cuts plain text does not matter)."""
    out = []
    for piece in pieces:
        if out and not piece.is_marker and not out[-1].is_marker:
            out[-1] = Piece(out[-1].text + piece.text, False)
        elif piece.text:
            out.append(piece)
    return out


def scan(markers: tuple[str, ...], pieces: list[str]) -> list[Piece]:
    scanner = MarkerScanner(markers)
    return joined([p for piece in pieces for p in scanner.feed(piece)] + scanner.finish())


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(["[A]", "[A]B", "[A", "B", "x", "[", "]"]), max_size=12).map("".join),
       data=st.data())
def test_the_scanner_finds_the_same_markers_in_any_split_even_where_one_marker_begins_another(text, data):
    markers = ("[A]", "[A]B")
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    whole = scan(markers, [text])
    assert scan(markers, cut(text, points)) == whole
    assert "".join(p.text for p in whole) == text
    assert all(p.text in markers for p in whole if p.is_marker)


def test_the_scanner_takes_the_longer_of_two_markers_that_begin_alike():
    assert scan(("[A]", "[A]B"), ["x[A]", "By[A]"]) == [Piece("x", False), Piece("[A]B", True), Piece("y", False),
                                                        Piece("[A]", True)]


def test_a_marker_inside_another_is_refused():
    with pytest.raises(ValueError, match="stands inside"):
        MarkerScanner(("<a>", "x<a>"))


def test_content_goes_out_as_soon_as_it_cannot_start_a_marker():
    reader = PARSERS["hermes"]().stream()
    assert reader.feed("Hello <tool") == [Delta(content="Hello ")]
    assert reader.feed("s are") == [Delta(content="<tools are")]
    assert reader.feed(" <tool_call>\n{") == [Delta(content=" ")]
    assert reader.feed('"name": "f", "arguments": {}}\n') == []
    [call] = reader.feed("</tool_call>")
    assert (call.index, call.name, call.arguments) == (0, "f", "{}")
    assert reader.finish() == []


def test_whitespace_only_content_is_none_and_never_streamed():
    text = "\n\n" + hermes("f", {}) + "\n" + hermes("g", {"a": 1}) + "\n"
    deltas = stream_deltas("hermes", list(text))
    assert all(d.content is None for d in deltas)
    assert PARSERS["hermes"]().parse(text).content is None


def test_a_lone_surrogate_in_arguments_stays_encodable():
    parsed = PARSERS["hermes"]().parse('<tool_call>{"name": "f", "arguments": {"s": "\\ud800 é"}}</tool_call>')
    [call] = parsed.tool_calls
    call.arguments.encode()
    assert json.loads(call.arguments) == {"s": "\ud800 é"}


def test_call_ids_differ():
    parsed = PARSERS["hermes"]().parse(HERMES_TWO)
    assert len({call.id for call in parsed.tool_calls}) == 2


@pytest.mark.parametrize("parser_name, opening", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"text": "'),
    ("glm45", "<tool_call>f\n<arg_key>text</arg_key>\n<arg_value>"),
    ("minimax_m2", '<invoke name="f">\n<parameter name="text">'),
    ("harmony", '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"text": "'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"text": "'),
])
def test_a_long_output_fed_a_character_at_a_time_takes_linear_work(parser_name, opening):
    text = opening + "ab<|}]\\\\ " * 20_000
    started = time.perf_counter()
    deltas = stream_deltas(parser_name, list(text))
    assert time.perf_counter() - started < 20
    assert assemble(deltas).content == text


def test_the_registry_names_each_parser_by_its_name():
    assert set(PARSERS) == {"hermes", "deepseek_v3", "glm45", "kimi_k2", "harmony", "mistral",
                            "minimax_m2"}
    assert all(parser.name == name for name, parser in PARSERS.items())


@pytest.mark.parametrize("template, expected", [
    ('{% for tool in tools %}...<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
     "hermes"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'}}", "deepseek_v3"),
    ("<tool_call>{{ tc.name }}{% for k, v in args %}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>",
     "glm45"),
    ("{{ '<|tool_calls_section_begin|>' }}{% for tc in calls %}<|tool_call_begin|>{% endfor %}", "kimi_k2"),
    ("{{- '<|start|>assistant<|channel|>commentary to=functions.' + name + '<|message|>' + args + '<|call|>' }}",
     "harmony"),
    ("{{ '[TOOL_CALLS]' + tool_calls | tojson }}", "mistral"),
    ("{{- '\\n<minimax:tool_call>\\n' }}{% for c in calls %}<invoke name=\"{{ c.name }}\">\\n<tool_call>{% endfor %}",
     "minimax_m2"),
    ("{{ '<|channel|>' }} only, no call marker", None),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ("", None),
    (None, None),
])
def test_a_template_chooses_its_parser(template, expected):
    parser = parser_for_template(template)
    assert (parser and parser.name) == expected


def test_the_parsers_import_nothing_of_the_engine():
    code = ("import sys, hybridmoe.server.tool_parsers, hybridmoe.server.reasoning\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith("
            "('hybridmoe.engine', 'hybridmoe.models'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
