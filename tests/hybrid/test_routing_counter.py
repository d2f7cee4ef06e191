"""RoutingCounter: install puts it between a model and its experts, reset counts again from zero, uninstall
puts the experts back (the model then runs as before, uncounted)."""

from hybridmoe.experts.placement_stats import RoutingCounter
from hybridmoe.llm import LLM
from hybridmoe.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 3, 60, 22]


def test_install_reset_uninstall(tiny_checkpoints):
    llm = LLM(tiny_checkpoints("qwen3_moe"), device="cpu", max_model_len=64)
    model = llm.engine.runner.model
    inner = model.experts
    holders = [m for m in model.modules() if getattr(m, "experts", None) is inner]
    counter = RoutingCounter.install(model)
    assert all(m.experts is counter for m in holders)
    llm.generate([PROMPT], GREEDY)
    top_k = model.config.num_experts_per_tok
    assert counter.tokens == len(PROMPT) + GREEDY.max_tokens - 1  # the last token is sampled, never run
    assert all(int(c.sum()) == counter.tokens * top_k for c in counter.counts.values())
    counter.reset()
    assert counter.tokens == 0 and all(int(c.sum()) == 0 for c in counter.counts.values())
    counter.uninstall(model)
    assert all(m.experts is inner for m in holders)
    llm.generate([PROMPT], GREEDY)
    assert counter.tokens == 0 and all(int(c.sum()) == 0 for c in counter.counts.values())
