"""Structured output on the GPU: decode steps replayed as CUDA graphs, grammar rows sampled from masked logits on
the device beside free rows; the JSON-schema rows validate and the free greedy rows decode what they decode alone.
Runs on the GPU host through scripts/device_check.sh."""

import dataclasses
import json

import jsonschema
import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.sampling_params import StructuredOutput

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["n", "tags"], "additionalProperties": False}


def test_grammar_rows_beside_free_rows_under_cuda_graphs(tmp_path):
    make_checkpoint("qwen3_moe", "tiny", tmp_path, progress=False)
    llm = LLM(str(tmp_path), device="cuda", max_num_seqs=4, max_model_len=256, cuda_graph=True)
    prompt = llm.encode("hello")
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate([prompt], free)[0].token_ids
    held = SamplingParams(max_tokens=120, temperature=1.0, seed=0,
                          structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    outs = llm.generate([prompt, prompt, prompt], [free, held, dataclasses.replace(held, seed=1)])
    assert outs[0].token_ids == alone
    for out in outs[1:]:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_greedy_grammar_rows_masked_on_the_device_decode_what_the_sampler_decodes(tmp_path):
    make_checkpoint("qwen3_moe", "tiny", tmp_path, progress=False)
    llm = LLM(str(tmp_path), device="cuda", max_num_seqs=4, max_model_len=256, cuda_graph=True)
    prompt = llm.encode("hello")
    held = SamplingParams(max_tokens=120, temperature=0, structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runner = llm.engine.runner
    runner.sample_on_device = False  # every row through the sampler on the host
    want = [o.token_ids for o in llm.generate([prompt, prompt, llm.encode("a b")], [held, free, held])]
    runner.sample_on_device = True  # grammar rows masked after each graph replay, the next step launched ahead
    outs = llm.generate([prompt, prompt, llm.encode("a b")], [held, free, held])
    assert [o.token_ids for o in outs] == want
    for out in (outs[0], outs[2]):
        jsonschema.validate(json.loads(out.text), SCHEMA)
