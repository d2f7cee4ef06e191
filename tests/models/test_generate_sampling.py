"""Sampling, stops and streaming through the whole engine (one family: this is engine behaviour)."""

import json

import pytest

from hybridmoe import LLM, SamplingParams

PROMPT = "Once upon a time, there was"


@pytest.fixture(scope="module")
def llm(tiny_qwen3_fp32):
    return LLM(tiny_qwen3_fp32, max_num_seqs=4)


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_batch(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded)[0].token_ids
    assert llm.generate(PROMPT, seeded)[0].token_ids == alone
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batch = llm.generate(["The sea is", PROMPT, "Hello"], [others, seeded, others])
    assert batch[1].token_ids == alone
    reseeded = SamplingParams(max_tokens=16, temperature=1.0, seed=4321, ignore_eos=True)
    assert llm.generate(PROMPT, reseeded)[0].token_ids != alone


def test_top_k_1_sampling_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    top1 = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids


def test_text_ends_before_a_stop_string(llm):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = llm.generate(PROMPT, params)[0]
    stop = full.text[5:8]  # a string the greedy completion is known to produce
    params.stop = [stop]
    out = llm.generate(PROMPT, params)[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]
    assert len(out.token_ids) < len(full.token_ids)


def test_a_stop_token_ends_generation_and_its_text_is_left_out(llm):
    full = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop_id = full.token_ids[6]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id],
                                              ignore_eos=True))[0]
    first = full.token_ids.index(stop_id)
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:first + 1]
    assert out.text == llm.tokenizer.decode(full.token_ids[:first])


def test_eos_from_generation_config_stops_unless_ignored(llm, tmp_path):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    full = llm.generate(PROMPT, greedy)[0].token_ids
    # The same checkpoint, but generation_config.json makes the 6th greedy token an EOS.
    for f in llm.engine.model_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [full[5]]}))
    other = LLM(tmp_path)
    out = other.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    first_eos = next(i for i, t in enumerate(full) if t in other.engine.eos_token_ids)
    assert full[5] in other.engine.eos_token_ids and first_eos <= 5
    assert out.finish_reason == "stop" and out.token_ids == full[:first_eos + 1]
    assert other.generate(PROMPT, greedy)[0].token_ids == full


def test_streamed_increments_add_up_to_the_final_output(llm):
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True, stop=["the"])
    pieces = list(llm.stream(PROMPT, params))
    final = llm.generate(PROMPT, params)[0]
    assert pieces[-1].finished and not any(p.finished for p in pieces[:-1])
    assert "".join(p.new_text for p in pieces) == pieces[-1].text == final.text
    assert [t for p in pieces for t in p.new_token_ids] == final.token_ids
