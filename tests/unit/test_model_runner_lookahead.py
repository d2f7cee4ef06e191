"""Fixed-shape decode steps that take their own greedy tokens and launch the next step ahead (ModelRunner's
sample_on_device and lookahead), run eagerly on the CPU, give the plain runner's tokens: when sequences stop
at a stop token (the step launched ahead is dropped), when a request arrives between steps, with sampled and
penalized rows beside greedy ones (those take the sampler), and with padding rows; and every step launched
ahead of an uninterrupted greedy decode is used.
"""

from types import SimpleNamespace

import pytest
from arrivals import generate_with_arrival

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.engine.model_runner import ModelRunner
from hybridmoe.sampling_params import StructuredOutput

PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [7, 13], [99, 2, 8, 31, 4], [11], [3, 3, 3], [8, 1], [42] * 9,
           [6, 60, 16], [70, 71], [20, 2, 12, 4]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    make_checkpoint("qwen3_moe", "tiny", path, dtype="fp32", seed=2, progress=False)
    return path


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, device="cpu", expert_backend="torch", max_num_seqs=16, max_model_len=32)


@pytest.fixture
def fixed(llm):
    """The same model behind a fixed-shape runner, its launches counted (inputs None: a step launched ahead)."""
    plain = llm.engine.runner
    plan = llm.engine.kv_plan
    runner = ModelRunner(plain.model, 16, 32, "cpu", fixed_shapes=True, num_blocks=plan.num_blocks,
                         block_size=plan.block_size)
    runner.sample_on_device = runner.lookahead = True
    runner.sampler = plain.sampler  # the engine's: it gets the grammars when the first request needs them
    launch = runner._launch
    runner.launches = []

    def counted(inputs, *args, **kwargs):
        runner.launches.append(inputs is None)
        return launch(inputs, *args, **kwargs)

    runner._launch = counted
    llm.engine.runner = runner
    yield runner
    llm.engine.runner = plain


def tokens(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_every_step_launched_ahead_of_a_greedy_decode_is_used(llm, fixed):
    want = tokens(llm, PROMPTS[:3], GREEDY)
    fixed.launches.clear()
    got = tokens(llm, PROMPTS[:3], GREEDY)
    assert got == want
    # the prompts' step runs eagerly; then 5 decode steps, the first launched by itself, 4 launched ahead
    assert fixed.launches == [False] + [True] * (GREEDY.max_tokens - 2)
    assert fixed._ahead is None and fixed._pinned is None


def test_the_step_ahead_of_a_stop_token_is_dropped(llm, fixed):
    fixed.sample_on_device = False
    free = tokens(llm, PROMPTS[:4], GREEDY)
    stop = free[1][2]  # the second sequence stops at its third token
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    want = tokens(llm, PROMPTS[:4], params)
    fixed.sample_on_device = True
    fixed.launches.clear()
    assert tokens(llm, PROMPTS[:4], params) == want
    assert len(want[1]) < GREEDY.max_tokens and any(fixed.launches) and fixed._ahead is None


def test_a_request_arriving_between_steps_drops_the_step_ahead(llm, fixed):
    def run() -> list[list[int]]:
        return generate_with_arrival(llm, PROMPTS[:3], GREEDY, arrive_at=3)  # decoding, with a step launched ahead

    fixed.sample_on_device = False
    want = run()
    fixed.sample_on_device = True
    fixed.launches.clear()
    assert run() == want
    assert any(fixed.launches)


def test_sampled_and_penalized_rows_take_the_sampler_beside_greedy_ones(llm, fixed):
    params = [GREEDY, SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)]
    fixed.sample_on_device = False
    want = [(o.token_ids, o.new_logprobs) for o in llm.generate(PROMPTS[:4], params)]
    fixed.sample_on_device = True
    fixed.launches.clear()
    for i in range(1, len(params)):  # each alone beside a greedy row: the sampler chooses every step's tokens
        sampler, calls = fixed.sampler, []
        fixed.sampler = SimpleNamespace(sample=lambda logits, seqs: calls.append(len(seqs)) or sampler.sample(logits, seqs))
        try:
            assert tokens(llm, [PROMPTS[0], PROMPTS[i]], [GREEDY, params[i]]) == [want[0][0], want[i][0]]
        finally:
            fixed.sampler = sampler
        assert calls == [2] * GREEDY.max_tokens
    assert [(o.token_ids, o.new_logprobs) for o in llm.generate(PROMPTS[:4], params)] == want
    assert not any(fixed.launches)  # no batch is all plain greedy: no step ahead


def test_padded_batches_decode_their_greedy_tokens_without_steps_ahead(llm, fixed):
    fixed.sample_on_device = False
    want = tokens(llm, PROMPTS, GREEDY)  # 10 sequences: 16 rows, 6 of them padding
    fixed.sample_on_device = True
    fixed.launches.clear()
    assert tokens(llm, PROMPTS, GREEDY) == want
    assert not any(fixed.launches)


def test_an_abort_mid_decode_drops_the_step_ahead_and_the_next_request_decodes_its_own_tokens(llm, fixed):
    want = tokens(llm, PROMPTS[1:2], GREEDY)
    engine = llm.engine
    request = engine.add_request(PROMPTS[0], GREEDY)
    for _ in range(3):
        engine.step()
    assert fixed._ahead is not None
    engine.abort(request)
    assert fixed._ahead is None and fixed._pinned is None
    assert tokens(llm, PROMPTS[1:2], GREEDY) == want


HELD = SamplingParams(max_tokens=6, temperature=0, structured=StructuredOutput("regex", "[a-z]{40}"))
SHORT = SamplingParams(max_tokens=12, temperature=0, structured=StructuredOutput("regex", "(yes|no)[0-9]{2}"))


@pytest.mark.parametrize("params", [[HELD, HELD], [GREEDY, HELD, GREEDY, HELD], [SHORT, GREEDY, SHORT]],
                         ids=["all-held", "held-beside-free", "grammar-completes"])
def test_greedy_rows_held_to_a_grammar_take_their_masked_tokens_on_the_device(llm, fixed, params):
    fixed.sample_on_device = False
    want = [(o.token_ids, o.finish_reason) for o in llm.generate(PROMPTS[:len(params)], params)]
    fixed.sample_on_device = True
    fixed.launches.clear()
    sampler, calls = fixed.sampler, []
    fixed.sampler = SimpleNamespace(grammars=sampler.grammars,
                                    sample=lambda logits, seqs: calls.append(len(seqs)) or sampler.sample(logits, seqs))
    try:
        got = [(o.token_ids, o.finish_reason) for o in llm.generate(PROMPTS[:len(params)], params)]
    finally:
        fixed.sampler = sampler
    assert got == want
    assert calls == [len(params)]  # the sampler draws the prompts' tokens only: every decode step masks on the device
    held = [tokens for (tokens, _), p in zip(got, params) if p.structured is not None]
    text = [llm.engine.tokenizer.decode(t) for t in held]
    if params[0] is SHORT:
        assert all(reason == "stop" for (_, reason), p in zip(got, params) if p is SHORT)
        assert all(t[:-2] in ("yes", "no") and t[-2:].isdigit() for t in text), text
    else:
        assert all(len(ids) == HELD.max_tokens for ids in held)
        assert all(t.isalpha() and t.islower() for t in text), text
        assert fixed.launches == [False] + [True] * (HELD.max_tokens - 2)  # every step after the first launched ahead
    assert fixed._ahead is None and fixed._pinned is None


def test_a_row_whose_grammar_cannot_go_on_ends_alone_with_an_error(llm, fixed):
    def run() -> tuple[dict, dict]:
        engine = llm.engine
        held = engine.add_request(PROMPTS[1], HELD)
        free = engine.add_request(PROMPTS[0], GREEDY)
        outs, finish = {held: [], free: []}, {}
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] += out.new_token_ids
                finish[out.request_id] = out.finish_reason
                if out.request_id == held and out.new_token_ids and len(outs[held]) == 2:
                    # its matcher takes a token the grammar forbids
                    assert not engine._requests[held].matcher.consume_token(llm.encode("7")[0])
        return [outs[held], outs[free]], [finish[held], finish[free]]

    fixed.sample_on_device = False
    want = run()
    fixed.sample_on_device = True
    assert run() == want
    assert want[1] == ["error", "length"] and len(want[0][0]) == 2 and want[0][1] == tokens(llm, PROMPTS[:1], GREEDY)[0]
