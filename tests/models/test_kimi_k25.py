"""Kimi-K2.5 (KimiK25ForConditionalGeneration) from make-model's tiny checkpoint in the release's layout: config.json's
text_config beside a vision_config, the text model's tensors under language_model., a MoonViT vision tower and its
projector beside them. Its text model gives exactly the logits and greedy tokens of the same weights laid out as a
Kimi-K2 checkpoint (DeepseekV3ForCausalLM), and transformers' DeepseekV3ForCausalLM's on them (float32); the vision
tensors are skipped and nothing else is; the release's int4 compressed-tensors experts, with the quantization_config
inside text_config, load as they do in the Kimi-K2 layout; a config.json without text_config fails in one line."""

import json
import logging
import shutil

import pytest
import torch
from compare import assert_forward_equals_transformers, run_step
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import save_file
from test_qwen3_next import GREEDY, hf_greedy
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from hybridmoe import LLM
from hybridmoe.checkpoint import make_checkpoint, model_config
from hybridmoe.checkpoint.tensors import tensor_specs
from hybridmoe.cli import main
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError
from hybridmoe.models.config_check import checked_config
from hybridmoe.models.registry import get_model_class, load_config
from hybridmoe.weights.convert import convert_checkpoint
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

PREFIX = "language_model."
VISION = ("vision_tower.", "mm_projector.")
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "generation_config.json")
PROMPT = torch.randint(0, 768, (40,), generator=torch.Generator().manual_seed(5)).tolist()  # tiktoken ranks only
GROUP = 32  # the tiny experts are [32, 64] and [64, 32]
TORCH = {"dtype": "float32", "expert_backend": "torch"}
NATIVE = {"expert_backend": "native", "cache_dir": "", "cpu_threads": 2}
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
"""The release's quantization_config ignore list: everything but the routed experts stays bf16."""


def read_tensors(model_dir) -> dict[str, torch.Tensor]:
    with SafetensorsCheckpoint(model_dir) as ckpt:
        return {name: ckpt.get(name).clone() for name in ckpt.file_of}


def write_checkpoint(out, tensors: dict[str, torch.Tensor], config: dict, tokenizer_from):
    """One model.safetensors, config.json, and the tokenizer files of tokenizer_from."""
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, out / name)
    return out


def as_kimi_k2(tensors: dict[str, torch.Tensor], config: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A Kimi-K2.5 checkpoint's text model as a Kimi-K2 checkpoint: no vision tensors, no prefix, the text config
    (with the top level's own keys) flat."""
    text = {name.removeprefix(PREFIX): t for name, t in tensors.items() if name.startswith(PREFIX)}
    outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config", "architectures",
                                                          "model_type")}
    return text, {**outer, **config["text_config"]}


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    out = tmp_path_factory.mktemp("kimi_k25") / "ckpt"
    summary = make_checkpoint("kimi_k25", "tiny", out, dtype="fp32", seed=1, progress=False)
    return out, summary.config


@pytest.fixture(scope="module")
def k2(k25, tmp_path_factory):
    """The same text weights in Kimi-K2's layout (DeepseekV3ForCausalLM, model_type kimi_k2)."""
    out, config = k25
    tensors, flat = as_kimi_k2(read_tensors(out), config)
    assert flat["architectures"] == ["DeepseekV3ForCausalLM"] and flat["model_type"] == "kimi_k2"
    return write_checkpoint(tmp_path_factory.mktemp("kimi_k2") / "ckpt", tensors, flat, out), flat


def logits_of(model_dir, **engine) -> torch.Tensor:
    """Our float32 logits [T, V] of PROMPT (the torch experts unless engine says otherwise)."""
    model = load_model(model_dir, EngineConfig(**TORCH | engine)).model
    model.allocate_kv_cache(1, len(PROMPT))
    return run_step(model, [PROMPT], slots=[0], start_pos=[0])[0]


def transformers_model(k2_dir, flat: dict) -> DeepseekV3ForCausalLM:
    """transformers has no kimi_k2 class: the Kimi-K2 layout loads in DeepseekV3ForCausalLM with its config."""
    config = DeepseekV3Config(**{k: v for k, v in flat.items() if k != "model_type"})
    return DeepseekV3ForCausalLM.from_pretrained(k2_dir, config=config, dtype=torch.float32).eval()


def test_the_files_are_in_kimi_k25s_layout(k25):
    out, config = k25
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"] and config["model_type"] == "kimi_k25"
    text = config["text_config"]
    assert text["architectures"] == ["DeepseekV3ForCausalLM"] and text["model_type"] == "kimi_k2"
    assert "hidden_size" not in config and config["vision_config"]["vt_num_hidden_layers"] == 1
    assert config["eos_token_id"] == text["eos_token_id"] == text["vocab_size"] - 255
    assert (out / "tiktoken.model").is_file() and not (out / "tokenizer.json").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "language_model.model.layers.2.mlp.experts.15.down_proj.weight" in index
    assert "language_model.lm_head.weight" in index and "lm_head.weight" not in index
    assert not [n for n in index if not n.startswith((PREFIX, *VISION))]
    assert {"vision_tower.encoder.blocks.0.wqkv.weight", "vision_tower.patch_embed.proj.weight",
            "mm_projector.proj.2.weight"} <= set(index)


def test_logits_equal_the_kimi_k2_layouts_exactly(k25, k2):
    (ours, config), (flat, _) = load_config(k25[0]), load_config(k2[0])
    assert (ours.__name__, flat.__name__) == ("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM")
    assert config.rms_norm_eps == 1e-5 and config.architectures == ["KimiK25ForConditionalGeneration"]
    assert torch.equal(logits_of(k25[0]), logits_of(k2[0]))


def test_logits_and_hidden_states_equal_transformers(k25, k2):
    ours = load_model(k25[0], EngineConfig(**TORCH)).model
    assert_forward_equals_transformers(ours, transformers_model(*k2), PROMPT)


def test_32_greedy_tokens_equal_the_kimi_k2_layouts_and_transformers(k25, k2):
    got = LLM(k25[0], **TORCH).generate(PROMPT, GREEDY)[0].token_ids
    assert got == LLM(k2[0], **TORCH).generate(PROMPT, GREEDY)[0].token_ids
    assert got == hf_greedy(transformers_model(*k2), PROMPT)


def test_the_vision_tensors_are_skipped_and_nothing_else_is(k25, tmp_path):
    out, config = k25
    tensors = read_tensors(out)
    vision = [n for n in tensors if n.startswith(VISION)]
    loaded = load_model(out, EngineConfig(**TORCH)).model
    assert vision and all(loaded.is_ignored(n) for n in vision)
    assert not [n for n, _ in loaded.named_parameters() if "vision" in n or "projector" in n]
    extra = "language_model.model.layers.0.self_attn.extra.weight"
    write_checkpoint(tmp_path / "extra", {**tensors, extra: torch.zeros(2)}, config, out)
    with pytest.raises(CheckpointError, match=f"checkpoint tensor {extra} is not part of "
                                              "KimiK25ForConditionalGeneration"):
        load_model(tmp_path / "extra", EngineConfig(**TORCH))


@pytest.mark.parametrize("name", ["language_model.model.layers.1.mlp.experts.3.up_proj.weight",
                                  "language_model.model.layers.0.self_attn.kv_b_proj.weight"])
def test_a_missing_text_tensor_is_named_in_the_release_layout(k25, tmp_path, name):
    out, config = k25
    tensors = read_tensors(out)
    del tensors[name]
    write_checkpoint(tmp_path / "ckpt", tensors, config, out)
    with pytest.raises(CheckpointError, match=f"missing tensor {name.replace('.', '[.]')}"):
        load_model(tmp_path / "ckpt", EngineConfig(**TORCH))


@pytest.mark.parametrize("text_config", [None, [1, 2]])
def test_a_config_without_text_config_fails_in_one_line(k25, tmp_path, text_config):
    _, config = k25
    flat = {**config["text_config"], "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25"}
    (tmp_path / "config.json").write_text(json.dumps(flat if text_config is None else
                                                     {**flat, "text_config": text_config}))
    with pytest.raises(CheckpointError, match="config.json of KimiK25ForConditionalGeneration must hold the text "
                                              "model's config as an object under text_config") as err:
        load_config(tmp_path)
    assert "\n" not in str(err.value)


def int4_packed(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """The routed experts pack-quantized by the compressed-tensors package (symmetric int4 in groups of GROUP, bf16
    scales), the rest as it is; and the quantization_config the package writes for it with the release's ignore
    list."""
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP))
    out = {}
    for name, w in tensors.items():
        if ".mlp.experts." not in name:
            out[name] = w
            continue
        groups = w.to(torch.bfloat16).float().unflatten(-1, (-1, GROUP))
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        parts = PackedQuantizationCompressor.compress(
            {"weight": w.to(torch.bfloat16), "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero},
            scheme)
        out |= {f"{name.removesuffix('.weight')}.{part}": t for part, t in parts.items()}
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                            quantization_status="compressed", ignore=IGNORE)
    return out, json.loads(qc.model_dump_json())


@pytest.fixture(scope="module")
def int4(k25, tmp_path_factory):
    """The tiny checkpoint with its routed experts pack-quantized as the release ships them (the quantization_config
    inside text_config, the packed experts under the prefix), and the same packed tensors in Kimi-K2's layout."""
    out, config = k25
    packed, qc = int4_packed(read_tensors(out))
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed" in packed
    root = tmp_path_factory.mktemp("int4")
    k25_dir = write_checkpoint(root / "k25", packed, {**config, "text_config": {
        **config["text_config"], "quantization_config": qc}}, out)
    tensors, flat = as_kimi_k2(packed, config)
    return k25_dir, write_checkpoint(root / "k2", tensors, {**flat, "quantization_config": qc}, out)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_int4_experts_with_the_quantization_config_in_text_config(int4, caplog, backend):
    """The native engine takes them as int4 in the checkpoint's groups; both backends compute what they compute on
    the same packed tensors in Kimi-K2's layout."""
    logits = []
    for model_dir in int4:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hybridmoe.weights"):
            logits.append(logits_of(model_dir, expert_backend=backend, cache_dir="", cpu_threads=2))
        if backend == "native":
            assert "routed experts: int4 g32 in the native engine" in caplog.text
            assert "compressed-tensors int4 g32" in caplog.text
    assert torch.equal(logits[0], logits[1])


def test_convert_packs_them_and_drops_the_nested_quantization_config(int4, tmp_path):
    summary = convert_checkpoint(int4[0], tmp_path / "out", format="int4", threads=1, progress=False)
    assert (summary.group_size, summary.zero_points) == (GROUP, False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
    assert torch.equal(logits_of(tmp_path / "out", **NATIVE), logits_of(int4[0], **NATIVE))


def test_make_model_writes_it(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["make-model", "--arch", "kimi_k25", "--preset", "tiny", "--out", str(out), "--layers", "2",
                 "--quiet"]) == 0
    assert "KimiK25ForConditionalGeneration tiny, 2 layers" in capsys.readouterr().out
    _, config = load_config(out)
    assert config.num_hidden_layers == 2 and config.first_k_dense_replace == 1


def test_the_real_preset_has_kimi_k25s_shapes():
    """The text model's shapes are Kimi-K2's (1026.41 billion parameters without a multi-token-prediction layer);
    the vision tower's and projector's are the release's (27 blocks of 1152, 2x2 patches merged into 7168)."""
    config = model_config("kimi_k25", "kimi-k2.5")
    specs = {s.name: s for s in tensor_specs(config)}
    text = sum(s.numel for n, s in specs.items() if n.startswith(PREFIX))
    assert text == sum(s.numel for s in tensor_specs(model_config("kimi_k2", "kimi-k2")))
    assert text / 1e9 == pytest.approx(1026.41, abs=0.01)
    assert sum(s.numel for n, s in specs.items() if n.startswith(VISION)) == 471_143_920
    shapes = {"language_model.lm_head.weight": (163840, 7168),
              "language_model.model.layers.60.mlp.experts.383.down_proj.weight": (7168, 2048),
              "language_model.model.layers.0.self_attn.kv_b_proj.weight": (16384, 512),
              "vision_tower.patch_embed.proj.weight": (1152, 3, 14, 14),
              "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1152),
              "vision_tower.encoder.blocks.26.wqkv.weight": (3456, 1152),
              "vision_tower.encoder.blocks.26.mlp.fc0.weight": (4304, 1152),
              "mm_projector.proj.0.weight": (4608, 4608), "mm_projector.proj.2.weight": (7168, 4608)}
    assert {n: specs[n].shape for n in shapes} == shapes
    assert "vision_tower.encoder.blocks.27.wo.weight" not in specs
    read = checked_config(get_model_class(config["architectures"][0]), config, "config.json")
    assert (read.max_position_embeddings, read.rms_norm_eps, read.rope_parameters["factor"]) == (262144, 1e-5, 64)
