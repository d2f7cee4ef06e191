"""Structured output in the engine: llguidance masks over the model's own vocabulary, checked on a tiny
checkpoint's tokenizer against plain-Python references (the bit layout, what each kind of grammar lets through),
and end to end through LLMEngine for every kind."""

import json
import re

import pytest
import torch

from hybridmoe.config import EngineConfig
from hybridmoe.engine.grammar import advance, unpack_bits, unpack_bits_torch
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.errors import HybridMoEError
from hybridmoe.sampling_params import MAX_GRAMMAR_CHARS, SamplingParams, StructuredOutput


@pytest.fixture(scope="module")
def engine(tiny_qwen3_fp32):
    return LLMEngine(str(tiny_qwen3_fp32), EngineConfig(device="cpu", max_num_seqs=4))


def run(engine, params_list):
    ids = engine.tokenizer.encode("hello")
    rids = [engine.add_request(ids, p) for p in params_list]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[r] for r in rids]


def test_unpack_bits_reads_bit_j_of_word_w_as_token_32w_plus_j():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (3, 4), generator=g, dtype=torch.int64).to(torch.int32)
    want = [[bool((int(bits[r, t // 32]) >> (t % 32)) & 1) for t in range(100)] for r in range(3)]
    assert unpack_bits(bits, 100).tolist() == want
    assert unpack_bits_torch(bits, 100).tolist() == want  # the GPU's unpacking, run here on the CPU


def test_the_mask_lets_through_exactly_the_tokens_that_continue_the_grammar(engine):
    grammars = engine.grammars()
    matcher = grammars.matcher(StructuredOutput("regex", "[0-9]{3}"))
    logits = torch.zeros(2, engine.vocab_size)
    grammars.mask(logits, [(1, matcher)])
    assert torch.isfinite(logits[0]).all()  # a row without a matcher is left alone
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    texts = {t: engine.tokenizer.decode([t], skip_special_tokens=False) for t in range(engine.vocab_size)}
    assert allowed and all(re.fullmatch(r"[0-9]{1,3}", texts[t]) for t in allowed)
    assert set(allowed) == {t for t, s in texts.items() if re.fullmatch(r"[0-9]{1,3}", s)}


def test_a_token_the_grammar_forbids_puts_the_matcher_in_error(engine):
    matcher = engine.grammars().matcher(StructuredOutput("regex", "[0-9]+"))
    letter = engine.tokenizer.encode("x", add_special_tokens=False)[0]
    assert "left its grammar" in advance(matcher, letter)


@pytest.mark.parametrize("spec,check", [
    (StructuredOutput("regex", "(yes|no), [a-c]{4}"), lambda t: re.fullmatch(r"(yes|no), [a-c]{4}", t)),
    (StructuredOutput("lark", 'start: "[" num ("," num)~0..2 "]"\nnum: /[1-9]/'),
     lambda t: re.fullmatch(r"\[[1-9](,[1-9]){0,2}\]", t)),
    (StructuredOutput("json_object"), lambda t: isinstance(json.loads(t), dict)),
    (StructuredOutput("json_schema", json.dumps({"type": "array", "items": {"enum": [1, 2]}, "minItems": 2,
                                                 "maxItems": 2})),
     lambda t: json.loads(t) in ([1, 1], [1, 2], [2, 1], [2, 2])),
])
def test_every_kind_holds_sampled_output_to_its_grammar(engine, spec, check):
    outs = run(engine, [SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured=spec) for s in range(3)])
    for o in outs:
        if spec.kind == "json_object" and o.finish_reason == "length":
            continue  # an object may be left open at max_tokens; a finished one must parse
        assert o.finish_reason == "stop" and check(o.text), (o.finish_reason, o.text)


def test_bad_specs_are_refused_with_what_is_wrong(engine):
    with pytest.raises(HybridMoEError, match="kind"):
        StructuredOutput("yaml", "x")
    with pytest.raises(HybridMoEError, match="at most"):
        StructuredOutput("regex", "a" * (MAX_GRAMMAR_CHARS + 1))
    with pytest.raises(HybridMoEError, match="not valid JSON"):
        engine.grammars().check(StructuredOutput("json_schema", "{nope"))
    with pytest.raises(HybridMoEError, match="cannot be used"):
        engine.grammars().check(StructuredOutput("lark", "start: foo("))
    with pytest.raises(HybridMoEError, match="cannot be used"):
        engine.add_request([1, 2], SamplingParams(structured=StructuredOutput("regex", "(")))
    assert not engine.has_unfinished()
