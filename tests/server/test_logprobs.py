"""Token log-probabilities: the engine's (SamplingParams.logprobs) equal log_softmax of
transformers' own logits for the same tokens, before penalties; the server returns them in
OpenAI's chat and completions formats, streamed or not."""

import math

import pytest
import torch

from hybridmoe.llm import LLM
from hybridmoe.sampling_params import SamplingParams

PROMPT = "Log probabilities of tiny experts"


@pytest.fixture(scope="module")
def llm(tiny_qwen3_fp32):
    return LLM(tiny_qwen3_fp32, dtype="float32")


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True),
    # penalties and sampling change the choice, not the reported (model) distribution
    SamplingParams(max_tokens=8, temperature=0.9, top_k=5, presence_penalty=1.5, seed=3, logprobs=2,
                   ignore_eos=True),
])
def test_engine_logprobs_equal_transformers(llm, tiny_qwen3_fp32, params):
    from transformers import AutoModelForCausalLM

    out = llm.generate(PROMPT, params)[0]
    steps = [o.new_logprobs for o in llm.stream(PROMPT, params)]
    logprobs = [lp for step in steps for lp in step]
    assert [lp.token_id for lp in logprobs] == out.token_ids
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_fp32, dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    with torch.no_grad():
        ref = hf(ids).logits[0].log_softmax(-1)  # [prompt + output, V]
    start = len(out.prompt_token_ids) - 1  # the logits at position p predict token p + 1
    for k, lp in enumerate(logprobs):
        row = ref[start + k]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        top_v, top_i = row.topk(params.logprobs)
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-4)


def test_no_logprobs_unless_asked(llm):
    assert llm.generate(PROMPT, SamplingParams(max_tokens=3))[0].new_logprobs is None


def test_chat_logprobs(server):
    client = server.client()
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=6,
                  logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the top token
        assert bytes(entry.bytes).decode("utf-8") == entry.token
    streamed = [e for c in client.chat.completions.create(stream=True, **kwargs) for ch in c.choices
                if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(server):
    client = server.client()
    kwargs = dict(model="tiny", prompt="hello", temperature=0, max_tokens=5, logprobs=2,
                  extra_body={"ignore_eos": True})
    lp = client.completions.create(**kwargs).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(math.isfinite(v) and v <= 0 for v in lp.token_logprobs)
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v)
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(5)]
    streamed = [v for e in client.completions.create(stream=True, **kwargs) if e.choices and e.choices[0].logprobs
                for v in e.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)


def test_top_logprobs_without_logprobs_is_an_error(server):
    code, _ = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                   "top_logprobs": 2})
    assert code == 400
