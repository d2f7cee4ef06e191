"""Which of a transformers MoE model's linear layers get LoRA adapters: --lora-targets, family by family.

    attention      the attention projections (default)
    attention+mlp  those and the shared experts' and dense MLP layers' projections (where the family has them)
    NAME,NAME,...  exactly these module names (peft matches a module whose name ends in one of them)

The routed experts run in the native CPU engine (OffloadedExperts, which holds no linear layer) and get none:
their weights are frozen, their backward gives the gradients of their input and routing weights only.
"""

from __future__ import annotations

from hybridmoe.errors import HybridMoEError

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLA_ATTENTION = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
"""DeepSeek's multi-head latent attention: q_proj where q_lora_rank is None, q_a_proj and q_b_proj where it is set."""

ATTENTION_OF = {"deepseek_v2": MLA_ATTENTION, "deepseek_v3": MLA_ATTENTION}
"""model_type -> its attention projections, where they are not ATTENTION."""

MLP = ("gate_proj", "up_proj", "down_proj")
"""The shared experts' and dense MLP layers' projections (Qwen2-MoE, DeepSeek-V2/V3, GLM-4.5); the routed experts
have no module of these names once offloaded."""

PRESETS = ("attention", "attention+mlp")


def lora_target_modules(targets: str, model) -> list[str]:
    """The module names peft's LoraConfig(target_modules=...) gets for --lora-targets `targets` on this model;
    HybridMoEError where one matches no linear layer of it."""
    model_type = getattr(model.config, "model_type", None)
    linear_names = {name.rpartition(".")[2] for name, module in model.named_modules()
                    if type(module).__name__ == "Linear"}
    if targets in PRESETS:
        names = [n for n in ATTENTION_OF.get(model_type, ATTENTION) if n in linear_names]
        if not names:
            raise HybridMoEError(f"found no attention projection ({', '.join(ATTENTION_OF.get(model_type, ATTENTION))})"
                                 f" in {type(model).__name__}; name the modules with --lora-targets NAME,NAME")
        if targets == "attention+mlp":
            mlp = [n for n in MLP if n in linear_names]
            if not mlp:
                raise HybridMoEError(f"{type(model).__name__} has no shared experts or dense MLP layers for "
                                     "--lora-targets attention+mlp; use attention")
            names += mlp
        return names
    names = [n.strip() for n in targets.split(",") if n.strip()]
    missing = [n for n in names if n not in linear_names]
    if not names or missing:
        raise HybridMoEError(f"--lora-targets {targets!r}: {', '.join(missing) or 'no name'} is no linear layer of "
                             f"{type(model).__name__} (it has {', '.join(sorted(linear_names))}); or use "
                             f"{' or '.join(PRESETS)}")
    return names
