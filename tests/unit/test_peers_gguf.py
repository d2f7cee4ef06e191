import json

import gguf
import pytest
import torch

from benchmarks.lib.peers_gguf import gguf_tensors, preset_config, write_random_gguf
from hybridmoe.checkpoint.tensors import tensor_specs
from hybridmoe.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.sampling_params import SamplingParams
from hybridmoe.weights.gguf_checkpoint import GGUFCheckpoint
from hybridmoe.weights.gguf_model_dir import resolve_model_path

PRESETS = ["qwen3_moe:tiny", "deepseek_v2:tiny", "glm4_moe:tiny"]
SAME_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts_per_tok",
             "moe_intermediate_size", "num_experts", "n_routed_experts", "n_shared_experts", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace", "head_dim",
             "num_key_value_heads", "n_group", "topk_group", "partial_rotary_factor", "use_qk_norm", "attention_bias",
             "routed_scaling_factor")


@pytest.fixture(scope="module", params=PRESETS)
def written(request, tmp_path_factory):
    config = preset_config(request.param, None)
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    write_random_gguf(config, path, seed=0, device="cpu")
    return config, path


def test_our_loader_reads_every_tensor_of_the_preset_at_its_shape(written):
    config, path = written
    model_dir = resolve_model_path(path, EngineConfig(cache_dir=""))
    loaded = json.loads((model_dir / "config.json").read_text())
    assert {k: loaded[k] for k in SAME_KEYS if k in config} == {k: config[k] for k in SAME_KEYS if k in config}
    ckpt = GGUFCheckpoint.from_model_dir(model_dir)
    expected = {s.name: s.shape for s in tensor_specs(config)}
    assert {name: ckpt.shape(name) for name in expected} == expected
    embed = ckpt.get("model.embed_tokens.weight")
    assert torch.isfinite(embed).all() and 0.9 < embed.std().item() < 1.1  # make-model's std 1


def test_experts_are_stacked_f16_and_routers_and_vectors_f32(written):
    config, _ = written
    types = {t.name: t.qtype for t in gguf_tensors(config)}
    assert types["blk.1.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.1.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32
    assert types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    shapes = {t.name: t.shape for t in gguf_tensors(config)}
    E = config.get("num_experts") or config["n_routed_experts"]
    assert shapes["blk.1.ffn_down_exps.weight"] == (E, config["hidden_size"], config["moe_intermediate_size"])


def test_the_file_generates_on_our_engine(written):
    _, path = written
    engine = LLMEngine(str(path), EngineConfig(device="cpu", cache_dir="", max_model_len=64, max_num_seqs=1))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert len(tokens) == 3
