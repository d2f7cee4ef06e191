import pytest
import torch

from hybridmoe import SamplingParams
from hybridmoe.engine.sampler import (
    Sampler,
    SamplerInput,
    apply_filters,
    apply_penalties,
)

V = 50


def logits_rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 3  # [n, V], distinct values almost surely


def row(params, prompt=(), output=(), seed_gen=None):
    return SamplerInput(params, list(prompt), list(output), seed_gen)


def kept(logits_row):
    return set(torch.isfinite(logits_row).nonzero().flatten().tolist())


def only(**kw):
    """Filter arguments for one row with every other filter disabled."""
    args = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | kw
    return (torch.tensor([args["temperature"]]), torch.tensor([args["top_k"]]),
            torch.tensor([args["top_p"]]), torch.tensor([args["min_p"]]))


def test_greedy_takes_the_argmax():
    logits = logits_rows(3)
    tokens = Sampler()(logits.clone(), [row(SamplingParams(temperature=0))] * 3)
    assert tokens == logits.argmax(-1).tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_once_per_token():
    logits = logits_rows(1)
    seen = [3, 7, 7, 11]  # prompt + output, with a repeat that must not be penalized twice
    out = apply_penalties(logits.clone(), [row(SamplingParams(repetition_penalty=1.3), seen[:2], seen[2:])])
    expected = logits.clone()
    for t in set(seen):
        v = logits[0, t]
        expected[0, t] = v * 1.3 if v < 0 else v / 1.3
    torch.testing.assert_close(out, expected)


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = logits_rows(1)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits.clone(), [row(params, prompt=[1, 2], output=[4, 4, 9])])
    expected = logits.clone()
    expected[0, 4] -= 0.5 + 2 * 0.25
    expected[0, 9] -= 0.5 + 1 * 0.25
    torch.testing.assert_close(out, expected)


def test_temperature_scales_logits():
    logits = logits_rows(1)
    out = apply_filters(logits, *only(temperature=0.7))
    torch.testing.assert_close(out, logits / 0.7)


@pytest.mark.parametrize("k", [1, 5, V, V + 10])
def test_top_k_keeps_the_k_largest(k):
    logits = logits_rows(1)
    out = apply_filters(logits, *only(top_k=k))
    order = sorted(range(V), key=lambda t: -logits[0, t].item())
    assert kept(out[0]) == set(order[:k])


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_keeps_the_smallest_head_reaching_p(p):
    logits = logits_rows(1, seed=1)
    out = apply_filters(logits, *only(top_p=p))
    probs = logits[0].double().softmax(-1).tolist()
    head, total = set(), 0.0
    for t in sorted(range(V), key=lambda t: -probs[t]):
        head.add(t)
        total += probs[t]
        if total >= p:
            break
    assert kept(out[0]) == head


@pytest.mark.parametrize("m", [0.01, 0.2, 1.0])
def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability(m):
    logits = logits_rows(1, seed=2)
    out = apply_filters(logits, *only(min_p=m))
    probs = logits[0].softmax(-1)
    assert kept(out[0]) == {t for t in range(V) if probs[t] >= m * probs.max()}


def test_filters_chain_like_transformers_warpers():
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
    logits = logits_rows(1, seed=3)
    ours = apply_filters(logits, *only(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05))
    hf = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(20), TopPLogitsWarper(0.9),
                              MinPLogitsWarper(0.05)])(None, logits.clone())
    assert kept(ours[0]) == kept(hf[0])
    torch.testing.assert_close(ours.softmax(-1), hf.softmax(-1))


def test_rows_get_their_own_filters():
    logits = logits_rows(2)
    out = apply_filters(logits, torch.tensor([1.0, 1.0]), torch.tensor([1, 0]),
                        torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    assert len(kept(out[0])) == 1 and len(kept(out[1])) == V


def test_sampling_stays_inside_the_filtered_set():
    logits = logits_rows(1).repeat(200, 1)
    params = SamplingParams(top_k=3, seed=0)
    rows = [row(params, seed_gen=torch.Generator().manual_seed(i)) for i in range(200)]
    tokens = set(Sampler()(logits.clone(), rows))
    assert tokens <= set(logits[0].topk(3).indices.tolist()) and len(tokens) > 1


def test_a_seeded_row_draws_the_same_tokens_alone_or_in_a_batch():
    logits = logits_rows(4)
    logits[2] = logits[0]  # the seeded request's logits: row 0 alone, row 2 in the batch
    params = SamplingParams(temperature=1.0, seed=7)

    def draw(batch_rows, index, steps=5):
        return [Sampler()(logits[:len(batch_rows)].clone(), batch_rows)[index] for _ in range(steps)]

    alone = draw([row(params, seed_gen=torch.Generator().manual_seed(7))], 0)
    others = [row(SamplingParams(temperature=1.0)) for _ in range(3)]
    batched = draw([others[0], others[1], row(params, seed_gen=torch.Generator().manual_seed(7)), others[2]], 2)
    assert alone == batched
    assert len(set(alone)) > 1
