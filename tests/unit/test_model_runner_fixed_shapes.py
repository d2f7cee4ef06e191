"""The model runner's fixed-shape decode steps (what a CUDA graph captures: static buffers, the
batch padded to a bucket with rows in a spare KV-cache slot, one padded attention length), run
eagerly on the CPU, give the tokens of the plain runner, for GQA and MLA, batch 1 and a batch
of 10 (padded to 16 rows).
"""

import pytest

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.engine.model_runner import ModelRunner

PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [7, 13], [99, 2, 8, 31, 4], [11], [3, 3, 3], [8, 1], [42] * 9,
           [6, 60, 16], [70, 71], [20, 2, 12, 4]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, "tiny", path, dtype="fp32", seed=2, progress=False)
    return path


def test_fixed_shape_decode_steps_give_the_plain_runners_tokens(checkpoint):
    llm = LLM(checkpoint, device="cpu", expert_backend="torch", max_num_seqs=16, max_model_len=32)
    want = [[o.token_ids for o in llm.generate(p, GREEDY)] for p in (PROMPTS[:1], PROMPTS)]
    engine = llm.engine
    engine.runner = ModelRunner(engine.runner.model, 16, 32, "cpu", fixed_shapes=True,
                                num_blocks=engine.kv_plan.num_blocks, block_size=engine.kv_plan.block_size)
    assert engine.runner.fixed
    got = [[o.token_ids for o in llm.generate(p, GREEDY)] for p in (PROMPTS[:1], PROMPTS)]
    assert got == want
