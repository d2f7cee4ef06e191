"""GPTQ/AWQ int4 experts go into the native int4 engine as codes, scales and zero points, never through
float: the engine then computes with exactly the checkpoint's weights. desc_act's permuted g_idx cannot
be laid out that way and goes through float."""

import json
import logging
import re

import pytest
import torch
from int4_packing import AWQ_ORDER, pack
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.forward_context import Context, use_context
from hybridmoe.models.registry import load_config
from hybridmoe.system.auto import resolve_engine_config
from hybridmoe.weights.convert import convert_checkpoint
from hybridmoe.weights.int4_codes import Int4Codes
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

GROUP = 32  # the tiny model's experts are [32, 64]: 32 is the one engine group size dividing both
PROMPT = [5, 17, 3, 60, 22, 9, 41]
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
NATIVE = dict(dtype="float32", expert_backend="native", cache_dir="", cpu_threads=2)


def quantize(w: torch.Tensor, g_idx: torch.Tensor, zero_range: tuple[int, int]):
    """Asymmetric 4-bit round-to-nearest of w [out, in] per group of input channels (g_idx [in]).

    -> codes [out, in], fp16 scales and integer zeros [groups, out] in zero_range (GPTQ v1 stores
    zero - 1 in 4 bits: 1..16), and their exact float32 dequantization.
    """
    n = int(g_idx.max()) + 1
    lo = torch.stack([w[:, g_idx == g].min(1).values for g in range(n)])  # [groups, out]
    hi = torch.stack([w[:, g_idx == g].max(1).values for g in range(n)])
    scales = ((hi - lo) / 15).clamp(min=1e-6).half()
    zeros = (-lo / scales.float()).round().clamp(*zero_range).long()
    s, z = scales.float()[g_idx].T, zeros[g_idx].T  # [out, in]
    q = (w / s).round().add(z).clamp(0, 15).long()
    return q, scales, zeros, (q - z).float() * s


def write_quantized(src, out, method):
    """The tiny checkpoint with its routed experts quantized by `method`; -> (dir, exact float32 experts)."""
    with SafetensorsCheckpoint(src) as ckpt:
        tensors = {n: ckpt.get(n) for n in ckpt.weight_names()}
    packed, decoded = {}, {}
    gen = torch.Generator().manual_seed(0)
    for name, w in tensors.items():
        if not EXPERT.fullmatch(name):
            packed[name] = w
            continue
        base, in_features = name[: -len(".weight")], w.shape[1]
        g_idx = torch.arange(in_features, dtype=torch.int32) // GROUP
        if method == "gptq_desc_act":  # channels join groups in a shuffled order
            g_idx = g_idx[torch.randperm(in_features, generator=gen)]
        q, scales, zeros, decoded[name] = quantize(w.float(), g_idx.long(), (1, 16) if method == "gptq" else (0, 15))
        if method == "awq":
            packed |= {base + ".qweight": pack(q.T, 1, AWQ_ORDER), base + ".qzeros": pack(zeros, 1, AWQ_ORDER),
                       base + ".scales": scales}
        else:  # the v1 format stores zero - 1, v2 the zero itself
            stored = zeros if method == "gptq_v2" else zeros - 1
            packed |= {base + ".qweight": pack(q.T, 0), base + ".qzeros": pack(stored, 1), base + ".scales": scales,
                       base + ".g_idx": g_idx}
    qc = ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
          if method == "awq" else
          {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": method == "gptq_desc_act",
           "sym": False, "checkpoint_format": "gptq_v2" if method == "gptq_v2" else "gptq"})
    out.mkdir()
    save_file(packed, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text())
                                                | {"quantization_config": qc}))
    return out, decoded


def write_reference(src, out, decoded):
    """The tiny checkpoint with the quantized experts' exact float32 weights."""
    with SafetensorsCheckpoint(src) as ckpt:
        tensors = {n: decoded.get(n, ckpt.get(n)).contiguous() for n in ckpt.weight_names()}
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text((src / "config.json").read_text())
    return out


def our_logits(model):
    model.allocate_kv_cache(1, 16)
    with torch.no_grad(), use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(PROMPT)])):
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))


def assert_experts_equal(loaded, decoded):
    for name, want in decoded.items():
        layer, expert, proj = EXPERT.fullmatch(name).groups()
        got = loaded.experts.layer_experts(int(layer)).dequantized(int(expert))[("gate", "up", "down").index(proj)]
        assert torch.equal(got, want), name


@pytest.mark.parametrize("method", ["gptq", "gptq_v2", "awq"])
def test_engine_weights_are_the_checkpoints_own_bit_for_bit(tiny_qwen3, tmp_path, caplog, method):
    quantized, decoded = write_quantized(tiny_qwen3, tmp_path / method, method)
    with caplog.at_level(logging.INFO, logger="hybridmoe.weights"):
        loaded = load_model(quantized, EngineConfig(**NATIVE))
    assert "routed experts: int4 g32 with zero points" in caplog.text
    assert "go through float" not in caplog.text
    assert_experts_equal(loaded, decoded)


def test_the_expert_cache_keeps_them_bit_for_bit(tiny_qwen3, tmp_path):
    quantized, decoded = write_quantized(tiny_qwen3, tmp_path / "gptq", "gptq")
    options = EngineConfig(**NATIVE | {"cache_dir": str(tmp_path / "cache")})
    assert_experts_equal(load_model(quantized, options), decoded)  # packs from codes, writes the cache
    (entry,) = (tmp_path / "cache" / "experts").iterdir()
    written = {f.name: f.stat().st_mtime_ns for f in entry.iterdir()}
    assert_experts_equal(load_model(quantized, options), decoded)  # maps the cache, leaves it as it is
    assert {f.name: f.stat().st_mtime_ns for f in entry.iterdir()} == written


def test_convert_to_int4_keeps_the_checkpoints_groups_and_codes(tiny_qwen3, tmp_path):
    quantized, decoded = write_quantized(tiny_qwen3, tmp_path / "gptq", "gptq")
    # an explicit int4 without --group-size: the checkpoint's g32 (the default 128 would re-quantize, and here
    # does not even divide the experts)
    summary = convert_checkpoint(quantized, tmp_path / "out", format="int4", threads=1, progress=False)
    assert (summary.group_size, summary.zero_points) == (GROUP, True)
    assert_experts_equal(load_model(tmp_path / "out", EngineConfig(**NATIVE)), decoded)


def test_load_as_int4_keeps_the_checkpoints_groups_and_codes(tiny_qwen3, tmp_path):
    quantized, decoded = write_quantized(tiny_qwen3, tmp_path / "gptq", "gptq")
    # an explicit int4 without expert_group_size loads as convert packs: in the checkpoint's g32
    assert_experts_equal(load_model(quantized, EngineConfig(**NATIVE, expert_format="int4")), decoded)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_logits_match_transformers_on_the_dequantized_weights(tiny_qwen3, tmp_path, method):
    quantized, decoded = write_quantized(tiny_qwen3, tmp_path / method, method)
    ref = write_reference(tiny_qwen3, tmp_path / "ref", decoded)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)(torch.tensor([PROMPT])).logits[0]
    got = our_logits(load_model(quantized, EngineConfig(**NATIVE)).model)
    # the engine's activations are int16/bf16: the bf16 tolerance
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1.6e-2)


def test_desc_act_permutation_falls_back_to_float_and_still_matches(tiny_qwen3, tmp_path, caplog):
    quantized, decoded = write_quantized(tiny_qwen3, tmp_path / "gptq", "gptq_desc_act")
    ref = write_reference(tiny_qwen3, tmp_path / "ref", decoded)
    with caplog.at_level(logging.INFO, logger="hybridmoe.weights"):
        got = our_logits(load_model(quantized, EngineConfig(**NATIVE)).model)
    assert "permuted g_idx (desc_act)" in caplog.text
    # the fallback is the engine quantizing the exact float weights, as it would from a float checkpoint
    from_float = our_logits(load_model(ref, EngineConfig(**NATIVE, expert_format="int4", expert_group_size=GROUP,
                                                         expert_zero_points=True)).model)
    torch.testing.assert_close(got, from_float, atol=0, rtol=0)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)(torch.tensor([PROMPT])).logits[0]
    # re-quantized in other groups: int4's error on top of the checkpoint's (4% of the logits here)
    assert ((got - want).norm() / want.norm()).item() < 0.08


@pytest.mark.parametrize("method,bits,want", [("gptq", 4, True), ("awq", 4, True), ("gptq", 8, False)])
def test_auto_chooses_zero_points_for_4_bit_gptq_and_awq(tiny_qwen3, tmp_path, method, bits, want):
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": bits, "group_size": GROUP}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, cfg = load_config(tmp_path)
    assert resolve_engine_config(EngineConfig(**NATIVE), cfg, torch.float32, tmp_path).expert_zero_points is want
    _, cfg = load_config(tiny_qwen3)
    assert resolve_engine_config(EngineConfig(**NATIVE), cfg, torch.float32, tiny_qwen3).expert_zero_points is False


def random_codes(E, N, K, group, gen, symmetric=False):
    return Int4Codes(torch.randint(0, 16, (E, N, K), dtype=torch.uint8, generator=gen),
                     torch.rand(E, N, K // group, generator=gen) * 0.05 + 0.01,
                     None if symmetric else torch.randint(0, 17, (E, N, K // group), generator=gen).float())


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("numa_nodes", [1, 2])
@pytest.mark.parametrize("symmetric", [False, True], ids=["zero-points", "symmetric"])
def test_from_codes_keeps_the_weights_and_computes_with_them(group, numa_nodes, symmetric):
    """Codes with zero points (GPTQ/AWQ) or without (symmetric: W = (code - 8) * scale, compressed-tensors'),
    packed as they are into a layer with or without zero points."""
    E, H, I, T = 3, 256, 128, 5  # I: 4 blocks of 32 rows, cut into numa_nodes slices
    gen = torch.Generator().manual_seed(group)
    mats = [random_codes(E, I, H, group, gen, symmetric), random_codes(E, I, H, group, gen, symmetric),
            random_codes(E, H, I, group, gen, symmetric)]
    experts = CpuExperts.from_codes(*mats, threads=2, numa_nodes=numa_nodes)
    assert experts.packed_state()["zero_points"] is not symmetric
    for e in range(E):
        for got, m in zip(experts.dequantized(e), mats):
            assert torch.equal(got, Int4Codes(*(None if t is None else t[e] for t in m)).dequantize())
    x = torch.randn(T, H, generator=gen)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    weights = torch.rand(T, 2, generator=gen)
    g, u, d = (m.dequantize() for m in mats)  # [E, N, K]
    want = torch.zeros(T, H)
    for t in range(T):
        for k in range(2):
            e = ids[t, k]
            want[t] += weights[t, k] * (torch.nn.functional.silu(g[e] @ x[t]) * (u[e] @ x[t])) @ d[e].T
    got = experts.forward(x, ids, weights)
    assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_zero_points_for_some_projections_only_are_refused():
    gen = torch.Generator().manual_seed(0)
    mats = [random_codes(1, 32, 64, 32, gen), random_codes(1, 32, 64, 32, gen, symmetric=True),
            random_codes(1, 64, 32, 32, gen)]
    with pytest.raises(HybridMoEError, match="zero points for every projection or for none"):
        CpuExperts.from_codes(*mats, threads=1)


def test_a_code_above_15_is_refused():
    gen = torch.Generator().manual_seed(0)
    mats = [random_codes(1, 32, 64, 32, gen), random_codes(1, 32, 64, 32, gen), random_codes(1, 64, 32, 32, gen)]
    mats[2].codes[0, 5, 7] = 16
    with pytest.raises(HybridMoEError, match="down code 16 .* is not an int4 code"):
        CpuExperts.from_codes(*mats, threads=1)


def test_a_layer_partly_in_codes_goes_through_float_as_a_whole(tiny_qwen3, tmp_path):
    quantized, decoded = write_quantized(tiny_qwen3, tmp_path / "gptq", "gptq")
    permuted, permuted_decoded = write_quantized(tiny_qwen3, tmp_path / "desc_act", "gptq_desc_act")
    # one expert of layer 0 with a permuted g_idx: the layer's other experts come as codes, then go through float
    prefix = "model.layers.0.mlp.experts.3."
    tensors = load_file(quantized / "model.safetensors")
    tensors |= {n: t for n, t in load_file(permuted / "model.safetensors").items() if n.startswith(prefix)}
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    decoded |= {n: t for n, t in permuted_decoded.items() if n.startswith(prefix)}
    loaded = load_model(quantized, EngineConfig(**NATIVE))
    assert_experts_equal(loaded, {n: t for n, t in decoded.items() if n.startswith("model.layers.1.")})
    ref = write_reference(tiny_qwen3, tmp_path / "ref", decoded)
    from_float = load_model(ref, EngineConfig(**NATIVE, expert_format="int4", expert_group_size=GROUP,
                                              expert_zero_points=True))
    for e in range(8):
        for got, want in zip(loaded.experts.layer_experts(0).dequantized(e),
                             from_float.experts.layer_experts(0).dequantized(e)):
            assert torch.equal(got, want), e


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_convert_keeps_the_codes_bit_for_bit(tiny_qwen3, tmp_path, method):
    quantized, decoded = write_quantized(tiny_qwen3, tmp_path / method, method)
    summary = convert_checkpoint(quantized, tmp_path / "converted", threads=1, progress=False)  # format "auto"
    assert (summary.format, summary.group_size, summary.zero_points) == ("int4", GROUP, True)
    assert_experts_equal(load_model(tmp_path / "converted", EngineConfig(**NATIVE)), decoded)
