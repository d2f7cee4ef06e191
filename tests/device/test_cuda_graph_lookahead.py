"""Decode steps replayed as CUDA graphs that take their own greedy tokens on the GPU (ModelRunner.sample_on_device)
and launch the next step before this one's tokens are read (lookahead) give the tokens of the sampler's path,
batch 1 and 4, when a sequence stops at a stop token (the step launched ahead is dropped) and when a request
arrives between steps; the graphs are captured again when the path is switched. Runs on the GPU host through
scripts/device_check.sh.
"""

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [7, 13], [99, 2, 8, 31, 4], [11]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
HYBRID = dict(expert_backend="native", expert_format="bf16", gpu_experts_per_layer=3, max_num_seqs=4,
              max_model_len=64, gpu_memory_budget=1 << 30)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def llm(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, "tiny", path, dtype="bf16", seed=1, progress=False)
    llm = LLM(path, device="cuda", **HYBRID)
    assert llm.engine.runner.cuda_graph
    return llm


def switch(llm, on: bool) -> list[bool]:
    """The runner's device path on or off; returns the list its launches are logged to (True: launched ahead)."""
    runner = llm.engine.runner
    runner.sample_on_device = runner.lookahead = on
    launches = []
    launch = type(runner)._launch

    def logged(inputs, *args, **kwargs):
        launches.append(inputs is None)
        return launch(runner, inputs, *args, **kwargs)

    runner._launch = logged
    return launches


def run(llm, params: SamplingParams, arrive_at: int | None = None) -> list[list[int]]:
    """Batch 1, then batch 4 (with arrive_at, the fourth request added after that many steps)."""
    engine = llm.engine
    out = [o.token_ids for o in llm.generate(PROMPTS[:1], params)]
    ids = [engine.add_request(p, params) for p in PROMPTS[:3 if arrive_at is not None else 4]]
    got, steps = {i: [] for i in ids}, 0
    while engine.has_unfinished():
        if steps == arrive_at:
            ids.append(engine.add_request(PROMPTS[3], params))
            got[ids[-1]] = []
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
        steps += 1
    return out + [got[i] for i in ids]


def test_tokens_taken_on_the_gpu_and_steps_launched_ahead_equal_the_samplers(llm):
    switch(llm, False)
    want = run(llm, GREEDY)
    retired = len(llm.engine.runner._retired)
    launches = switch(llm, True)
    assert run(llm, GREEDY) == want
    assert sum(launches) >= 2 * (GREEDY.max_tokens - 3)  # batch 1 and 4: every step after the first two, ahead
    assert len(llm.engine.runner._retired) > retired  # the graphs were captured again for the device path


def test_a_stop_token_or_a_request_arriving_drops_the_step_ahead(llm):
    switch(llm, False)
    free = run(llm, GREEDY)
    stop = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[free[2][4]])
    want = [run(llm, stop), run(llm, GREEDY, arrive_at=4)]
    launches = switch(llm, True)
    assert [run(llm, stop), run(llm, GREEDY, arrive_at=4)] == want
    assert any(launches) and llm.engine.runner._ahead is None
    switch(llm, False)
