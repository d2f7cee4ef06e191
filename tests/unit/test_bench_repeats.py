"""run_suite's repeats: the rows of one engine measured in turn, round after round, each reported as the median
of its samples; an interruption still returns the rows measured (the complete rounds)."""

import pytest

import hybridmoe.bench.suite as suite
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.experts.tuning import HybridTuning


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    make_checkpoint("qwen3_moe", "tiny", out, progress=False)
    return str(out)


def fake_sampler(monkeypatch, decode_s, stop_at=None):
    """Replace _sample: the n-th call returns decode_s[n] and records how many prompt lengths it was given
    (the "all on" row prefills every length, the others the first only); call stop_at raises Interrupted."""
    calls = []

    def sample(engine, prompts, decode_prompt, gen_len, decode_runs, *, first, **kw):
        if len(calls) == stop_at:
            raise Interrupted
        calls.append((len(prompts), first))
        d = decode_s[len(calls) - 1]
        return suite.Sample({n: 1.0 / d for n in prompts}, {n: d for n in prompts}, d, None)

    monkeypatch.setattr(suite, "_sample", sample)
    return calls


class Interrupted(BaseException):
    pass


def run(model_dir, repeats):
    return suite.run_suite("all on", model_dir, EngineConfig(device="cpu", max_num_seqs=1, expert_backend="torch"),
                           [16, 32], 4, 1e9, "probe", decode_prompt_len=8, eager_label="no graph", repeats=repeats)


def test_rows_are_interleaved_and_each_reports_the_median_of_its_samples(model_dir, monkeypatch):
    calls = fake_sampler(monkeypatch, [1.0, 5.0, 3.0, 6.0, 2.0, 4.0])
    on, off = run(model_dir, repeats=3)
    # each round starts one row later: on off, off on, on off
    assert calls == [(2, True), (1, True), (1, False), (2, False), (2, False), (1, False)]
    assert on.decode_samples_s == [1.0, 6.0, 2.0] and on.decode_s == 2.0
    assert off.decode_samples_s == [5.0, 3.0, 4.0] and off.decode_s == 4.0
    assert off.decode_spread == pytest.approx((5.0 - 3.0) / 4.0)
    assert on.prefill_samples == {16: [1.0, 1 / 6, 0.5], 32: [1.0, 1 / 6, 0.5]} and on.prefill_tok_s[32] == 0.5
    assert set(off.prefill_tok_s) == {16} and off.cuda_graph is False and off.resolved.cuda_graph is False


def test_a_sample_is_the_median_of_its_decode_runs(monkeypatch):
    from types import SimpleNamespace as NS

    rates = iter([0.1, 1.0, 4.0, 2.0])  # tok/s: the untimed decode (capturing graphs), then three timed runs
    monkeypatch.setattr(suite, "_measure", lambda engine, prompts, gen_len: {"decode_tok_s": next(rates)})
    engine = NS(runner=NS(model=NS(experts=NS())))
    sample = suite._sample(engine, {}, [1], 4, 3, first=False, layer_times=False, bandwidth=1e9,
                           bandwidth_method="probe")
    assert sample.decode_s == 0.5  # of 1, 0.25 and 0.5 s per token


def test_an_interruption_after_the_first_round_comes_with_the_complete_rounds(model_dir, monkeypatch):
    fake_sampler(monkeypatch, [1.0, 5.0, 3.0], stop_at=3)  # stops in round 2, after "no graph" got its sample
    with pytest.raises(Interrupted) as stopped:
        run(model_dir, repeats=3)
    on, off = stopped.value.results
    assert on.decode_samples_s == [1.0] and off.decode_samples_s == [5.0]


def test_an_interruption_in_the_first_round_comes_with_the_rows_done(model_dir, monkeypatch):
    fake_sampler(monkeypatch, [1.0], stop_at=1)
    with pytest.raises(Interrupted) as stopped:
        run(model_dir, repeats=3)
    (on,) = stopped.value.results
    assert on.label == "all on" and on.decode_samples_s == [1.0]


def test_an_interruption_before_any_row_is_done_has_no_rows(model_dir, monkeypatch):
    fake_sampler(monkeypatch, [], stop_at=0)
    with pytest.raises(Interrupted) as stopped:
        run(model_dir, repeats=1)
    assert not hasattr(stopped.value, "results")


def test_deferral_rows_switch_k_on_the_loaded_engine(model_dir, monkeypatch):
    switched = []
    from hybridmoe.experts.hybrid import HybridExperts

    real = HybridExperts.set_deferred_experts
    monkeypatch.setattr(HybridExperts, "set_deferred_experts", lambda self, k: (switched.append(k), real(self, k)))
    ec = EngineConfig(device="cpu", max_num_seqs=1, expert_backend="torch", gpu_experts_per_layer=1)
    on, k1 = suite.run_suite("K0", model_dir, ec, [16], 3, 1e9, "probe", decode_prompt_len=8,
                             deferral_variants=(("K1", 1),), repeats=2)
    assert switched == [1, 0]  # K0 K1, K1 K0 (each round starts one row later): a switch where the row changes
    assert (on.resolved.deferred_experts, k1.resolved.deferred_experts) == (0, 1)
    assert len(on.decode_samples_s) == len(k1.decode_samples_s) == 2


def test_a_handoff_row_that_changes_nothing_measures_the_other_way():
    defaults = {"trim_padding": True, "zero_copy": False}
    assert suite.toggled("int4 trim padding", {"trim_padding": True}, defaults) == \
        ("int4 trim padding off", {"trim_padding": False})
    assert suite.toggled("int4 zero-copy", {"zero_copy": True}, defaults) == ("int4 zero-copy", {"zero_copy": True})
    assert suite.toggled("int4 all on, again", {}, defaults) == ("int4 all on, again", {})


def test_an_expert_option_row_sets_the_experts_and_the_next_row_its_own_value_again():
    """pin_decode_thread (EXPERT_OPTIONS) is set on the hybrid experts' tuning, RUNNER_OPTIONS on the model runner, the
    handoff options on each handoff; a row without options puts the engine's own values back."""
    from types import SimpleNamespace as NS

    handoff = NS(path="stream_mem_ops", zero_copy=True, trim_padding=True)
    experts = NS(_handoffs={(False, 0): (handoff, 4), (False, 1): (handoff, 4)}, tuning=HybridTuning())
    runner = NS(model=NS(experts=experts), cuda_graph=True, _graphs={}, sample_on_device=False, lookahead=True)
    engine = NS(runner=runner, resolved_config=NS(deferred_experts=0), config=NS(device="cuda"))
    bench = suite._Bench(engine, [1], 4, 1e9, "probe", False)
    assert bench.defaults == {"zero_copy": True, "trim_padding": True, "pin_decode_thread": True,
                              "help_decode_wait": True, "prefetch_next": True, "sample_on_device": False,
                              "lookahead": True}
    bench._set_up(suite.Row("int4 unpinned", True, {"pin_decode_thread": False}, False))
    assert experts.tuning.pin_decode_thread is False and not hasattr(handoff, "pin_decode_thread")
    bench._set_up(suite.Row("int4 helping wait off", True, {"help_decode_wait": False}, False))
    assert experts.tuning.help_decode_wait is False and experts.tuning.pin_decode_thread is True
    bench._set_up(suite.Row("int4 next-layer prefetch off", True, {"prefetch_next": False}, False))
    assert experts.tuning.prefetch_next is False and experts.tuning.help_decode_wait is True
    bench._set_up(suite.Row("int4 step ahead", True, {"sample_on_device": True}, False))
    assert runner.sample_on_device is True and not hasattr(experts.tuning, "sample_on_device")
    assert experts.tuning.pin_decode_thread is True and experts.tuning.help_decode_wait is True
    assert experts.tuning.prefetch_next is True
    bench._set_up(suite.Row("int4 zero-copy off", True, {"zero_copy": False}, False))
    assert (experts.tuning.pin_decode_thread, handoff.zero_copy) == (True, False)
    bench._set_up(suite.Row("int4 all on", True, None, True))
    assert (experts.tuning.pin_decode_thread, handoff.zero_copy, runner.sample_on_device) == (True, True, False)


def test_repetitions_prefill_every_prompt_token_again(model_dir, monkeypatch):
    """The same prompts are prefilled in every round: none of their tokens may come from a prefix cache
    (which the engine keeps by default), or the rounds after the first time a cache hit, not a prefill."""
    measure, hits = suite._measure, []

    def counting(engine, prompts, gen_len):
        timing = measure(engine, prompts, gen_len)
        hits.append(engine.scheduler.pool.stats.hit_tokens)
        return timing

    monkeypatch.setattr(suite, "_measure", counting)
    (result,) = suite.run_suite("all on", model_dir, EngineConfig(device="cpu", max_num_seqs=1, kv_block_size=16),
                                [64], 3, 1e9, "probe", decode_prompt_len=8, repeats=2)
    assert hits and hits[-1] == 0
    assert result.resolved.prefix_caching is False
