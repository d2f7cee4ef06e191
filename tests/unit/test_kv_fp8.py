"""The float8 KV cache (layers/kv_quant.py, --kv-cache-dtype fp8): rows round-trip within e4m3's precision
through a shuffled block table, the cache takes about half a bf16 cache's bytes, and a model reading it gives
nearly the logits of one reading an unquantized cache (teacher-forced: the same tokens through both)."""

import sys
from pathlib import Path

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.layers.kv_quant import FP8, read_positions, write_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from compare import run_step  # noqa: E402


def test_rows_round_trip_within_e4m3_precision_through_a_block_table():
    g = torch.Generator().manual_seed(0)
    store, scale = torch.zeros(6, 4, 2, 8, dtype=FP8), torch.zeros(6, 4, 2, 1)
    x = torch.randn(20, 2, 8, generator=g) * torch.logspace(-3, 3, 20)[:, None, None]  # rows of any range
    table = torch.tensor([[5, 2, 4, 1, 3]], dtype=torch.int32)  # positions 0-3 in block 5, 4-7 in block 2, ...
    rows = table[0, torch.arange(20) // 4].long() * 4 + torch.arange(20) % 4
    write_rows(store, scale, rows, x)
    got = read_positions(store, scale, table[0], 20, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    assert ((got - x).abs() <= amax / 16).all()  # 3 mantissa bits of each row's own range
    assert (store[0].float() == 0).all()  # block 0 is no sequence's: untouched


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def bf16_checkpoint(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, "tiny", d, dtype="bf16", progress=False, force=True)
    return d


def test_a_model_reading_the_fp8_cache_gives_nearly_the_unquantized_logits(bf16_checkpoint):
    model = load_model(bf16_checkpoint, EngineConfig(expert_backend="torch")).model
    ids = torch.randint(0, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = {}
    for quantized in (False, True):
        model.allocate_kv_cache(1, 300, quantized=quantized)
        with torch.inference_mode():
            (logits[quantized],) = run_step(model, [ids], [0], [0])
    exact, fp8 = logits[False].float(), logits[True].float()
    assert not torch.equal(exact, fp8)  # the cache is really quantized
    agree = (exact.argmax(-1) == fp8.argmax(-1)).float().mean()
    kl = torch.nn.functional.kl_div(fp8.log_softmax(-1), exact.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    assert agree >= 0.93 and kl.mean() < 0.01  # random bf16 tiny models: 0.965-0.99 and 0.001-0.003 measured


def test_the_fp8_engine_takes_about_half_the_memory_and_reuses_prefixes_alike(bf16_checkpoint):
    plain = LLM(bf16_checkpoint, kv_block_size=16)
    fp8 = LLM(bf16_checkpoint, kv_block_size=16, kv_cache_dtype="fp8")
    assert fp8.engine.kv_plan.bytes_per_token == plain.engine.model_config.num_hidden_layers * (
        fp8.engine.runner.model.model.layers[0].self_attn.kv_bytes_per_token(quantized=True))
    assert fp8.engine.kv_plan.bytes_per_token < 0.7 * plain.engine.kv_plan.bytes_per_token
    no_cache = LLM(bf16_checkpoint, kv_block_size=16, kv_cache_dtype="fp8", prefix_caching=False)
    prompt = torch.randint(0, plain.engine.vocab_size, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = fp8.generate(prompt, params)[0]
    again = fp8.generate(prompt + first.token_ids, params)[0]  # its cached blocks hold the same float8 codes
    assert again.num_cached_tokens == 96
    assert again.token_ids == no_cache.generate(prompt + first.token_ids, params)[0].token_ids


def test_a_slot_of_consecutive_blocks_reads_as_a_view_equal_to_the_gather():
    from hybridmoe.layers.kv_quant import gather_positions

    cache = torch.randn(8, 4, 2, 3)
    table = torch.tensor([[3, 4, 5, 6]], dtype=torch.int32)
    view = gather_positions(cache, table[0], 13, first_block=3)
    assert torch.equal(view, gather_positions(cache, table[0], 13))
    assert view.data_ptr() == cache[3].data_ptr()  # no copy
    batched = gather_positions(cache, table, 13, first_block=3)
    assert torch.equal(batched, gather_positions(cache, table, 13)) and batched.shape == (1, 13, 2, 3)
