"""LLM / LLMEngine as callers use them: chat, request errors, directories without a tokenizer, abort."""

import pytest

from hybridmoe import LLM, SamplingParams
from hybridmoe.errors import HybridMoEError

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen3_fp32):
    return LLM(tiny_qwen3_fp32, max_num_seqs=2, max_model_len=64)


def test_chat_answers_the_templated_conversation(llm):
    messages = [{"role": "user", "content": "Hello!"}]
    out = llm.chat(messages, GREEDY)[0]
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    generation_prompt = llm.tokenizer.encode("<|im_start|>assistant\n")
    assert out.prompt_token_ids == ids and ids[-len(generation_prompt):] == generation_prompt
    assert out.token_ids == llm.generate([ids], GREEDY)[0].token_ids


def test_token_id_and_text_prompts_give_the_same_result(llm):
    text = llm.generate("The sea is", GREEDY)[0]
    ids = llm.generate(llm.tokenizer.encode("The sea is"), GREEDY)[0]
    assert text.token_ids == ids.token_ids and text.text == ids.text


@pytest.mark.parametrize("prompt, params, needle", [
    ([], GREEDY, "prompt is empty"),
    ([1] * 60, SamplingParams(max_tokens=10), "prompt of 60 tokens \\+ max_tokens 10 = 70 exceeds the context of 64"),
    ([1, 10**6], GREEDY, "token id 1000000 is outside the vocabulary"),
    (3.5, GREEDY, "a prompt is a string or a list of token ids"),
])
def test_bad_requests_raise_clear_errors(llm, prompt, params, needle):
    with pytest.raises(HybridMoEError, match=needle):
        llm.generate(prompt if prompt != [] else [[]], params)
    assert not llm.engine.has_unfinished()


def test_more_prompts_than_slots_queue_and_all_finish(llm):
    outs = llm.generate(["a", "b", "c", "d", "e"], GREEDY)
    assert [len(o.token_ids) for o in outs] == [6] * 5


def test_an_aborted_request_frees_its_slot_at_once(llm):
    engine = llm.engine
    first = engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
    second = engine.add_request([8, 9], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    assert engine.abort(first) and not engine.abort(first)
    third = engine.add_request([10], SamplingParams(max_tokens=2, ignore_eos=True))
    assert {o.request_id for o in engine.step()} == {second, third}  # third got the freed slot
    engine.abort(second)
    while engine.has_unfinished():
        engine.step()
    assert sorted(engine.scheduler.free_slots) == [0, 1]


def test_closing_a_stream_early_aborts_its_request(llm):
    stream = llm.stream("Once upon a time", SamplingParams(max_tokens=20, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()


def test_a_directory_without_tokenizer_takes_token_ids_only(tiny_qwen3_fp32, tmp_path):
    for f in tiny_qwen3_fp32.iterdir():
        if not f.name.startswith("tokenizer"):
            (tmp_path / f.name).symlink_to(f)
    llm = LLM(tmp_path)
    out = llm.generate([[5, 6, 7]], GREEDY)[0]
    assert len(out.token_ids) == 6 and out.text == ""
    with pytest.raises(HybridMoEError, match="no tokenizer.json, so text prompts cannot be encoded"):
        llm.generate("hello", GREEDY)
    with pytest.raises(HybridMoEError, match="stop strings need a tokenizer"):
        llm.generate([[5]], SamplingParams(stop=["x"]))
