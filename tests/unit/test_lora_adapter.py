"""A PEFT LoRA adapter, as peft's save_pretrained writes it, merged at load (EngineConfig.lora, --lora DIR) gives the
logits and the greedy tokens of the peft model it was saved from; an adapter that cannot be merged (routed experts,
router, embeddings, lm_head, a LoRA variant, another base model) fails the load with a one-line error naming it."""

import json
import logging
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint import make_checkpoint
from hybridmoe.cli import main
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError
from hybridmoe.forward_context import Context, use_context

PROMPT = [5, 17, 3, 60, 22, 9, 41, 30, 2]
NEW_TOKENS = 16
ENGINE = {"dtype": "float32", "expert_backend": "torch", "device": "cpu"}
QWEN_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLA_AND_MLPS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj",
                "mlp.down_proj", "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"]
"""DeepSeek-V3's MLA projections, its dense first layer's MLP and its shared experts; spelled with their parent, since
peft (with transformers 5) takes a bare gate_proj/up_proj/down_proj for the fused routed experts' parameters too."""


def lora(**options) -> LoraConfig:
    """r 4, alpha 8, B drawn at random (init_lora_weights False) so that the adapter changes the model."""
    return LoraConfig(**{"r": 4, "lora_alpha": 8, "init_lora_weights": False, **options})


def perturb_biases(peft_model) -> None:
    """Move every trainable bias and the modules_to_save copies off their initial values, as training would."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if name.endswith("bias") or "modules_to_save" in name:
                param.add_(0.5 * torch.randn(param.shape, generator=generator))


CASES = {
    "qwen3_moe-attention": ("qwen3_moe", lambda: lora(target_modules=QWEN_ATTENTION), None),
    "deepseek_v3-mla-dense-shared": ("deepseek_v3", lambda: lora(target_modules=MLA_AND_MLPS), None),
    # rsLoRA, a rank and an alpha of their own for some modules, lora_B biases, trained base biases and a module
    # saved whole: each is part of what the merge must reproduce
    "qwen2_moe-rslora-patterns-biases": ("qwen2_moe", lambda: lora(
        target_modules=["q_proj", "k_proj", "v_proj"], use_rslora=True, rank_pattern={"k_proj": 2},
        alpha_pattern={"v_proj": 3}, lora_bias=True, bias="lora_only", modules_to_save=["shared_expert_gate"]),
        perturb_biases),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> a tiny fp32 checkpoint of it, made on first use."""
    made = {}

    def checkpoint(arch: str):
        if arch not in made:
            made[arch] = tmp_path_factory.mktemp(arch) / "ckpt"
            make_checkpoint(arch, "tiny", made[arch], dtype="fp32", seed=3, progress=False)
        return made[arch]
    return checkpoint


def save_adapter(checkpoint, config: LoraConfig, out, tweak=None):
    """The peft model of config over checkpoint, its adapter saved to out."""
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32), config)
    if tweak is not None:
        tweak(peft_model)
    peft_model.save_pretrained(out)
    return peft_model.eval()


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens of a transformers (or peft) model after ids, one full forward each."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


@torch.no_grad()
def our_logits(checkpoint, adapter=None) -> torch.Tensor:
    model = load_model(checkpoint, EngineConfig(**ENGINE, lora=None if adapter is None else str(adapter))).model
    model.allocate_kv_cache(1, 32)
    with use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(PROMPT)])):
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))


@pytest.fixture(scope="module", params=list(CASES))
def adapted(request, checkpoints, tmp_path_factory):
    """(checkpoint, adapter directory, the peft model's logits on PROMPT and its greedy tokens after it)."""
    arch, config, tweak = CASES[request.param]
    checkpoint = checkpoints(arch)
    adapter = tmp_path_factory.mktemp("adapter") / request.param
    peft_model = save_adapter(checkpoint, config(), adapter, tweak)
    with torch.no_grad():
        logits = peft_model(torch.tensor([PROMPT])).logits[0]
    return checkpoint, adapter, logits, greedy(peft_model, PROMPT, NEW_TOKENS)


def test_merged_adapter_gives_the_peft_models_logits_and_tokens(adapted):
    checkpoint, adapter, want_logits, want_tokens = adapted
    torch.testing.assert_close(our_logits(checkpoint, adapter), want_logits, atol=1e-4, rtol=1e-4)
    assert (our_logits(checkpoint) - want_logits).abs().max() > 0.1  # the adapter is what makes them agree
    out = LLM(checkpoint, lora=str(adapter), **ENGINE).generate(
        PROMPT, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == want_tokens


@pytest.fixture(scope="module")
def qwen3(checkpoints, tmp_path_factory):
    """The qwen3_moe checkpoint and its attention adapter."""
    checkpoint = checkpoints("qwen3_moe")
    adapter = tmp_path_factory.mktemp("qwen3_adapter") / "attention"
    save_adapter(checkpoint, lora(target_modules=QWEN_ATTENTION), adapter)
    return checkpoint, adapter


def test_the_load_logs_one_line_with_path_rank_and_modules(qwen3, caplog):
    checkpoint, adapter = qwen3
    with caplog.at_level(logging.INFO, logger="hybridmoe.weights"):
        load_model(checkpoint, EngineConfig(**ENGINE, lora=str(adapter)))
    lines = [r.getMessage() for r in caplog.records if "LoRA" in r.getMessage()]
    # 2 layers x q/k/v/o
    assert lines == [f"LoRA adapter {adapter}: rank 4, 8 modules merged (k_proj, o_proj, q_proj, v_proj)"]


def test_run_takes_the_adapter(qwen3, capsys):
    checkpoint, adapter = qwen3
    rc = main(["run", "--model", str(checkpoint), "--lora", str(adapter), "--prompt", "Once upon a time",
               "--max-new-tokens", "8", "--temperature", "0", "--ignore-eos", "--dtype", "float32",
               "--expert-backend", "torch", "--device", "cpu"])
    out = capsys.readouterr().out
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    adapted = LLM(checkpoint, lora=str(adapter), **ENGINE).generate("Once upon a time", params)[0]
    base = LLM(checkpoint, **ENGINE).generate("Once upon a time", params)[0]
    assert rc == 0 and out == adapted.text + "\n"
    assert adapted.token_ids != base.token_ids


def test_run_refuses_an_adapter_on_routed_experts_in_one_line(qwen3, tmp_path, capsys):
    checkpoint, _ = qwen3
    adapter = tmp_path / "experts"
    save_adapter(checkpoint, lora(target_modules=[], target_parameters=["mlp.experts.gate_up_proj"]), adapter)
    capsys.readouterr()  # transformers' progress bar, not ours
    rc = main(["run", "--model", str(checkpoint), "--lora", str(adapter), "--prompt", "Hi", "--dtype", "float32",
               "--expert-backend", "torch", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "(model.layers.0.mlp.experts); routed-expert LoRA is not supported at inference" in err


def hand_written(base_adapter, out, change) -> None:
    """A copy of base_adapter with change(tensors) applied to its tensors, in peft's key format."""
    out.mkdir()
    shutil.copy(base_adapter / "adapter_config.json", out / "adapter_config.json")
    tensors = load_file(base_adapter / "adapter_model.safetensors")
    change(tensors)
    save_file(tensors, out / "adapter_model.safetensors")


def one_line_error(checkpoint, adapter) -> str:
    with pytest.raises(CheckpointError) as e:
        LLM(checkpoint, lora=str(adapter), **ENGINE)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("config, needle", [
    (lora(target_modules=["gate"]), "adapts the router (model.layers.0.mlp.gate); LoRA on the router is not supported"),
    (lora(target_modules=["embed_tokens"]), "adapts model.embed_tokens; LoRA on the embeddings or lm_head is not"),
    (lora(target_modules=["lm_head"]), "adapts lm_head; LoRA on the embeddings or lm_head is not supported"),
    (lora(target_modules=["q_proj"], use_dora=True), "is a LoRA variant (use_dora); only plain LoRA merges"),
    (lora(target_modules=["q_proj"], init_lora_weights="pissa"), "init_lora_weights 'pissa', which rewrites the base"),
], ids=["router", "embeddings", "lm_head", "dora", "pissa"])
def test_what_does_not_merge_is_refused_naming_it(qwen3, tmp_path, config, needle):
    checkpoint, _ = qwen3
    save_adapter(checkpoint, config, tmp_path / "adapter")
    assert needle in one_line_error(checkpoint, tmp_path / "adapter")


def test_an_adapter_on_one_routed_expert_module_is_refused(qwen3, tmp_path):
    checkpoint, base_adapter = qwen3

    def add_expert_pair(tensors):  # a transformers 4 model's per-expert module, as peft names it
        module = "base_model.model.model.layers.1.mlp.experts.3.gate_proj"
        tensors[f"{module}.lora_A.weight"] = torch.randn(4, 64)
        tensors[f"{module}.lora_B.weight"] = torch.randn(32, 4)
    hand_written(base_adapter, tmp_path / "expert", add_expert_pair)
    error = one_line_error(checkpoint, tmp_path / "expert")
    assert "(model.layers.1.mlp.experts.3.gate_proj); routed-expert LoRA is not supported at inference" in error


def test_an_adapter_of_another_base_model_is_refused_naming_the_module(qwen3, checkpoints, tmp_path):
    checkpoint, base_adapter = qwen3
    save_adapter(checkpoints("deepseek_v3"), lora(target_modules=["q_a_proj"]), tmp_path / "mla")
    error = one_line_error(checkpoint, tmp_path / "mla")
    assert "adapts model.layers.0.self_attn.q_a_proj, which Qwen3MoeForCausalLM with this config.json" in error

    def widen_k_proj(tensors):
        tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"] = torch.randn(48, 4)
    hand_written(base_adapter, tmp_path / "wide", widen_k_proj)
    error = one_line_error(checkpoint, tmp_path / "wide")
    assert "model.layers.0.self_attn.k_proj.lora_B has shape [48, 4], where this model needs [32, 4]" in error


def test_a_directory_without_an_adapter_is_a_one_line_error(qwen3, tmp_path):
    checkpoint, base_adapter = qwen3
    assert "has no adapter_config.json" in one_line_error(checkpoint, tmp_path)
    config = json.loads((base_adapter / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    assert "has peft_type 'IA3'; only LoRA adapters" in one_line_error(checkpoint, tmp_path)


def test_modules_past_the_last_layer_are_skipped_and_said(checkpoints, tmp_path, caplog):
    checkpoint = checkpoints("deepseek_v3")  # 3 layers; DeepSeek-V3's multi-token-prediction layer comes after them
    save_adapter(checkpoint, lora(target_modules=["q_a_proj"]), tmp_path / "mla")

    def add_mtp_pair(tensors):
        module = "base_model.model.model.layers.3.self_attn.q_a_proj"
        tensors[f"{module}.lora_A.weight"] = torch.randn(4, 64)
        tensors[f"{module}.lora_B.weight"] = torch.randn(32, 4)
    hand_written(tmp_path / "mla", tmp_path / "with_mtp", add_mtp_pair)
    with caplog.at_level(logging.INFO, logger="hybridmoe.weights"):
        load_model(checkpoint, EngineConfig(**ENGINE, lora=str(tmp_path / "with_mtp")))
    assert caplog.records[-1].getMessage() == (f"LoRA adapter {tmp_path / 'with_mtp'}: rank 4, 3 modules merged "
                                               "(q_a_proj); 1 modules the model does not run skipped")
