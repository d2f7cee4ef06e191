"""A request arriving while others decode, driven through the engine's steps: shared by the fixed-shape and
CUDA-graph tests of several folders (tests/ is on sys.path, as tests/conftest.py's folder)."""

from hybridmoe import LLM, SamplingParams


def generate_with_arrival(llm: LLM, prompts: list[list[int]], params: SamplingParams,
                          arrive_at: int) -> list[list[int]]:
    """Every prompt but the last added at once, the last after arrive_at engine steps -> each request's tokens, in
    the prompts' order."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts[:-1]]
    got = {i: [] for i in ids}
    steps = 0
    while engine.has_unfinished():
        if steps == arrive_at:
            ids.append(engine.add_request(prompts[-1], params))
            got[ids[-1]] = []
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        steps += 1
    return [got[i] for i in ids]
