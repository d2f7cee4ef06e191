"""The multi-token-prediction module of Qwen3-Next and Qwen3.5-MoE (models/mtp.py), in float32: make-model writes it
when config.json asks for it; mtp=True loads it, and mtp_logits over a sequence in several steps (through the MTP
layer's own KV cache) equals a reference built from transformers' own decoder layer and the torch ops vLLM's and
SGLang's MTP run around it; the hybrid split takes its experts as one more MoE layer; without mtp nothing of it is
held; a missing tensor, another family or deferred experts fail the load, naming why.

The checkpoints are make-model's tiny ones with mtp_num_hidden_layers 1 (its weights random at O(1) scale).
"""

import copy
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint import make_checkpoint
from hybridmoe.checkpoint.tensors import tensor_specs
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError, HybridMoEError
from hybridmoe.forward_context import Context, single_sequence_context, use_context
from hybridmoe.weights.expert_cache import MANIFEST

ARCHS = ["qwen3_next", "qwen3_5_moe"]
MTP = {"mtp_num_hidden_layers": 1}
IDS = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(7))
"""A sequence of 24 tokens: the MTP runs at positions 0-22, each with the token after it."""
STEPS = (9, 1, 6, 1, 1, 5)
"""The MTP's steps over positions 0-22: a prefill, single tokens as decoding brings them, a chunk."""
TORCH = {"dtype": "float32", "device": "cpu", "expert_backend": "torch"}


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    """(arch, directory) of make-model's tiny float32 checkpoint with one MTP layer."""
    out = tmp_path_factory.mktemp(request.param) / "ckpt"
    make_checkpoint(request.param, "tiny", out, dtype="fp32", seed=2, progress=False, overrides=MTP)
    return request.param, out


def _tensors(out) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next's RMSNorm, scaled by 1 + weight (vLLM's GemmaRMSNorm)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def _decoder_layer_state(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """mtp.layers.0.* as transformers' decoder layer holds them: routed experts fused, gate before up."""
    prefix = "mtp.layers.0."
    state = {n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix) and ".experts." not in n}

    def expert(e: int, proj: str) -> torch.Tensor:
        return tensors[f"{prefix}mlp.experts.{e}.{proj}_proj.weight"]

    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([expert(e, "gate"), expert(e, "up")])
                                                     for e in range(num_experts)])
    state["mlp.experts.down_proj"] = torch.stack([expert(e, "down") for e in range(num_experts)])
    return state


@torch.no_grad()
def reference_mtp_logits(out) -> torch.Tensor:
    """The MTP's logits at positions 0-22 of IDS [23, V], from transformers' model of the checkpoint (its
    final-normed hidden states, embeddings and lm_head), its decoder layer class built full-attention at index 0
    with mtp.layers.0's weights, and torch ops for the rest: fc(cat(norm(embed(next)), norm(hidden))), then the
    layer over positions 0-22 causally, then mtp.norm."""
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tensors = _tensors(out)
    config = copy.deepcopy(hf.config)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    layer = type(hf.model.layers[0])(config, 0).float().eval()
    layer.load_state_dict(_decoder_layer_state(tensors, config.num_experts))
    eps, n = config.rms_norm_eps, len(IDS) - 1
    hidden = hf(IDS[None, :-1], output_hidden_states=True).hidden_states[-1][0]  # after the final norm
    embeds = hf.model.embed_tokens(IDS[1:])
    x = torch.cat([_norm(embeds, tensors["mtp.pre_fc_norm_embedding.weight"], eps),
                   _norm(hidden, tensors["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1)
    h = (x @ tensors["mtp.fc.weight"].T)[None]
    positions = torch.arange(n)[None]
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    h = layer(h, position_embeddings=hf.model.rotary_emb(h, positions), attention_mask=causal,
              position_ids=positions)[0]
    return hf.lm_head(_norm(h, tensors["mtp.norm.weight"], eps))


@torch.no_grad()
def our_mtp_logits(model, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Our model's forward over IDS[:-1] in one step, then mtp_logits over it in STEPS (slot 0; the contiguous
    slot table of allocate_kv_cache, or block_table [1, M] where the engine holds the cache)."""
    n = len(IDS) - 1
    positions = torch.arange(n)

    def context(tokens: int, start: int) -> Context:
        ctx = single_sequence_context(tokens, start_pos=start)
        ctx.block_table = block_table
        return ctx

    with use_context(context(n, 0)):
        hidden = model(IDS[:-1], positions)
    logits, start = [], 0
    for step in STEPS:
        span = slice(start, start + step)
        with use_context(context(step, start)):
            logits.append(model.mtp_logits(hidden[span], IDS[1:][span], positions[span]))
        start += step
    assert start == n
    return torch.cat(logits)


def test_make_model_writes_the_mtp_tensors_only_when_asked(checkpoint):
    arch, out = checkpoint
    names = list(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    config = json.loads((out / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1
    mtp = [n for n in names if n.startswith("mtp.")]
    assert names[-len(mtp):] == mtp  # after the main model's tensors
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.k_norm.weight",
            "mtp.layers.0.mlp.gate.weight", "mtp.layers.0.mlp.experts.7.down_proj.weight",
            "mtp.layers.0.mlp.shared_expert_gate.weight", "mtp.layers.0.post_attention_layernorm.weight"} <= set(mtp)
    assert not any("linear_attn" in n for n in mtp)  # the MTP layer is full attention
    hidden = config["hidden_size"]
    assert _tensors(out)["mtp.fc.weight"].shape == (hidden, 2 * hidden)
    without = [s.name for s in tensor_specs({**config, "mtp_num_hidden_layers": 0})]
    assert without == names[:-len(mtp)]
    with pytest.raises(HybridMoEError, match="cannot override num_nextn_predict_layers"):
        make_checkpoint(arch, "tiny", out.parent / "other", overrides={"num_nextn_predict_layers": 1})


def test_mtp_logits_over_steps_equal_the_reference(checkpoint):
    _, out = checkpoint
    loaded = load_model(out, EngineConfig(**TORCH, mtp=True))
    model = loaded.model
    L = model.config.num_hidden_layers
    assert model.moe_layers[-1] == L and loaded.experts.layers() == model.moe_layers
    model.allocate_kv_cache(1, 32)
    torch.testing.assert_close(our_mtp_logits(model), reference_mtp_logits(out), atol=1e-4, rtol=1e-4)


def test_the_hybrid_split_places_the_mtp_layer_experts_too(checkpoint):
    """Two experts of every MoE layer, the MTP's included, on the 'GPU' (the CPU standing in for it)."""
    _, out = checkpoint
    loaded = load_model(out, EngineConfig(**TORCH, mtp=True, gpu_experts_per_layer=2))
    L = loaded.config.num_hidden_layers
    assert loaded.experts.gpu_experts(L) == [0, 1] and loaded.experts.cpu_engine(L).num_experts == 6
    loaded.model.allocate_kv_cache(1, 32)
    torch.testing.assert_close(our_mtp_logits(loaded.model), reference_mtp_logits(out), atol=1e-4, rtol=1e-4)


def test_without_mtp_nothing_of_it_is_held(checkpoint):
    _, out = checkpoint
    with_mtp = load_model(out, EngineConfig(**TORCH, mtp=True)).model
    loaded = load_model(out, EngineConfig(**TORCH))
    model = loaded.model
    assert model.mtp is None and not any(n.startswith("mtp.") for n, _ in model.named_parameters())
    assert model.moe_layers == with_mtp.moe_layers[:-1] and loaded.experts.layers() == model.moe_layers
    attention = with_mtp.mtp.layers[0].self_attn
    assert with_mtp.kv_bytes_per_token() == model.kv_bytes_per_token() + attention.kv_bytes_per_token()
    with pytest.raises(HybridMoEError, match="loaded without its multi-token-prediction module"):
        model.mtp_logits(torch.zeros(1, model.config.hidden_size), IDS[:1], torch.zeros(1, dtype=torch.long))


def test_the_engine_allocates_the_mtp_cache_and_generates_as_without(checkpoint):
    """LLM(mtp=True): its KV plan counts the MTP layer, the MTP layer's cache takes the engine's blocks, its greedy
    tokens are those without mtp (the engine does not run the MTP); llm.engine.runner.model.mtp_logits, through a
    block table of the engine's blocks, gives the reference's logits."""
    _, out = checkpoint
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = LLM(out, **TORCH)
    llm = LLM(out, **TORCH, mtp=True)
    model = llm.engine.runner.model
    attention = model.mtp.layers[0].self_attn
    assert llm.engine.kv_plan.bytes_per_token == plain.engine.kv_plan.bytes_per_token + attention.kv_bytes_per_token()
    main_attention = next(layer.self_attn for layer in model.model.layers if layer.mixer_name == "self_attn")
    assert attention.kv_cache.k.shape == main_attention.kv_cache.k.shape
    blocks = torch.arange(1, 1 + -(-len(IDS) // llm.engine.runner.block_size), dtype=torch.int32)[None]
    torch.testing.assert_close(our_mtp_logits(model, blocks), reference_mtp_logits(out), atol=1e-4, rtol=1e-4)
    prompt = IDS[:10].tolist()
    assert llm.generate(prompt, greedy)[0].token_ids == plain.generate(prompt, greedy)[0].token_ids


def _drop(out, tmp_path, name: str):
    """A copy of checkpoint `out` without tensor `name`."""
    copy_dir = tmp_path / "dropped"
    copy_dir.mkdir()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for f in out.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (copy_dir / f.name).write_bytes(f.read_bytes())
    for shard in sorted(out.glob("*.safetensors")):
        save_file({n: t for n, t in load_file(shard).items() if n != name}, copy_dir / shard.name,
                  metadata={"format": "pt"})
    del index["weight_map"][name]
    (copy_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return copy_dir


@pytest.mark.parametrize("name", ["mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.mlp.experts.5.up_proj.weight"])
def test_a_missing_mtp_tensor_fails_the_load_naming_it(checkpoint, tmp_path, name):
    _, out = checkpoint
    dropped = _drop(out, tmp_path, name)
    with pytest.raises(CheckpointError, match=f"checkpoint is missing tensor {name.replace('.', '[.]')}"):
        load_model(dropped, EngineConfig(**TORCH, mtp=True))
    assert load_model(dropped, EngineConfig(**TORCH)).model.mtp is None  # without mtp it is not looked for


def test_mtp_is_refused_where_it_cannot_load(tiny_qwen3_fp32, tmp_path):
    with pytest.raises(HybridMoEError, match="Qwen3MoeForCausalLM has no multi-token-prediction module"):
        load_model(tiny_qwen3_fp32, EngineConfig(**TORCH, mtp=True))
    # config.json names no MTP layer count (as Qwen3-Next's releases): one layer is looked for
    unnamed = tmp_path / "unnamed"
    make_checkpoint("qwen3_next", "tiny", unnamed, dtype="fp32", progress=False)
    with pytest.raises(CheckpointError, match=r"checkpoint is missing tensor mtp\.\S+ \(and \d+ more\)"):
        load_model(unnamed, EngineConfig(**TORCH, mtp=True))
    with pytest.raises(HybridMoEError, match="deferred_experts 1 cannot run with the MTP layer"):
        load_model(unnamed, EngineConfig(**TORCH, mtp=True, deferred_experts=1))
    none = tmp_path / "none"
    make_checkpoint("qwen3_next", "tiny", none, dtype="fp32", progress=False, overrides={"mtp_num_hidden_layers": 0})
    with pytest.raises(HybridMoEError, match="declares no multi-token-prediction layer"):
        load_model(none, EngineConfig(**TORCH, mtp=True))


def test_starts_with_and_without_mtp_each_keep_their_own_packed_expert_cache_entry(tmp_path):
    """The cache key covers --mtp (the MTP module's MoE layer beside the model's own): alternating starts map their
    own entries back, with no warning and no repacking over each other's."""
    out = tmp_path / "ckpt"
    make_checkpoint("qwen3_next", "tiny", out, dtype="bf16", seed=1, progress=False, overrides=MTP)
    cache = tmp_path / "cache"

    def start(mtp: bool) -> None:
        load_model(out, EngineConfig(expert_backend="native", expert_format="int8", cache_dir=str(cache), mtp=mtp))

    def written() -> dict[str, int]:
        """Each entry's manifest and when it was written: an entry packed again is written again."""
        return {m.parent.name: m.stat().st_mtime_ns for m in (cache / "experts").glob(f"*/{MANIFEST}")}

    start(True)
    start(False)
    entries = written()
    assert len(entries) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning here: an entry was ignored and packed again
        for mtp in (True, False, True):
            start(mtp)
    assert written() == entries
