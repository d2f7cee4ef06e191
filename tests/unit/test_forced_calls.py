"""tool_choice "required" and named functions as grammars, per tool-call format: a random walk through each
grammar over a vocabulary whose markers are special tokens (as the real models' are) always writes calls that the
format's own parser reads back, with names among the tools and arguments that validate against their schemas."""

import json
import random

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from hybridmoe.engine.grammar import Grammars
from hybridmoe.server.protocol import NamedToolChoice, ToolDef
from hybridmoe.server.tool_choice import GRAMMARS, forced_calls, marker_for
from hybridmoe.server.tool_parsers import PARSERS
from hybridmoe.tokenizer import Tokenizer

MARKERS = {
    "hermes": [],  # Qwen's <tool_call> tags are ordinary (non-special) added tokens: spelled as text
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>"],
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_end|>", "<|tool_call_argument_begin|>"],
    "mistral": ["[TOOL_CALLS]"],
    "glm45": ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
    "minimax_m2": ["<minimax:tool_call>", "</minimax:tool_call>"],
    "harmony": ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"],
}
EOS = "<eos>"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [ToolDef.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}),
         ToolDef.model_validate({"type": "function", "function": {"name": "get_time", "parameters": TIME}})]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def vocabulary(markers: list[str]) -> Tokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS, *markers],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(['{"name": "get_weather", "arguments": {"city": "Paris"}} functions.get_time:0 '
                             '```json get_time zone UTC CET <tool_call> </tool_call>'], trainer=trainer)
    return Tokenizer(tok, {}, None)


def walk(grammars: Grammars, spec, seed: int, eos: int, limit: int = 600) -> list[int]:
    """Random tokens the grammar allows until it ends (EOS taken as soon as it is allowed, half the time)."""
    rng, matcher, out = random.Random(seed), grammars.matcher(spec), []
    for _ in range(limit):
        logits = torch.zeros(1, grammars.vocab_size)
        grammars.mask(logits, [(0, matcher)])
        allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
        token = eos if eos in allowed and (len(allowed) == 1 or rng.random() < 0.5) else rng.choice(
            [t for t in allowed if t != eos])
        assert matcher.consume_token(token), matcher.get_error()
        if token == eos:
            return out
        out.append(token)
    raise AssertionError("the grammar did not end")


@pytest.mark.parametrize("name", sorted(GRAMMARS))
@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False),
                                             (NamedToolChoice.model_validate(
                                                 {"type": "function", "function": {"name": "get_time"}}), True)])
def test_every_walk_through_a_forced_grammar_parses_to_valid_calls(name, choice, parallel):
    tokenizer = vocabulary(MARKERS[name])
    eos = tokenizer.special_token_id(EOS)
    grammars = Grammars.build(tokenizer.to_json(), tokenizer.vocab_size, [eos])
    spec = forced_calls(name, TOOLS, choice, parallel, marker_for(tokenizer))
    for seed in range(8):
        text = tokenizer.decode(walk(grammars, spec, seed, eos), skip_special_tokens=False)
        parsed = PARSERS[name]().parse(text)
        assert parsed.tool_calls, (name, text)
        assert not (parsed.content or "").strip(), (name, text)
        if isinstance(choice, NamedToolChoice) or not parallel:
            assert len(parsed.tool_calls) == 1
        for call in parsed.tool_calls:
            assert isinstance(choice, str) or call.name == "get_time"
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_every_format_the_server_reads_has_a_grammar_of_calls():
    assert set(GRAMMARS) == set(PARSERS)


def test_a_marker_that_is_one_special_token_is_named_by_its_id():
    tokenizer = vocabulary(MARKERS["mistral"])
    assert marker_for(tokenizer)("[TOOL_CALLS]") == f"<[{tokenizer.special_token_id('[TOOL_CALLS]')}]>"
    assert marker_for(tokenizer)("<tool_call>") == '"<tool_call>"'


def test_glm_needs_parameters_with_plain_properties():
    from hybridmoe.server.serving_common import APIError

    tool = ToolDef.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}]}}})
    with pytest.raises(APIError, match="plain properties"):
        forced_calls("glm45", [tool], "required", True)
