"""hybridmoe inside a Hugging Face transformers model: the routed experts run in hybridmoe's native CPU expert
engine, everything else stays the user's transformers model (its router and shared experts, attention, hooks,
output_hidden_states, generate()).

    import hybridmoe.hf
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hybridmoe.hf.offload_experts(model, expert_format="int4", expert_group_size=64)   # in place
    model = hybridmoe.hf.from_pretrained(path, torch_dtype=torch.bfloat16, expert_format="int4")  # packed as read

Supported: the transformers 5 models of Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2, DeepSeek-V3, GLM-4.5
(Glm4Moe), gpt-oss and MiniMax-M2 (family_layouts.py: which module holds a layer's experts and how its tensors
lie). Each layer's Experts module becomes an OffloadedExperts (offloaded_experts.py) holding a CpuExperts
(experts/cpu_experts.py); offload.py replaces them in a loaded model, pretrained.py builds the model without
them and packs them from the checkpoint (checkpoint_experts.py). transformers is needed only here, imported when
a function runs: `import hybridmoe` never imports it.

Training: the experts stay frozen, and their backward (the engine's) gives the gradients of their input and routing
weights, so adapters anywhere else and the router train. finetune.py trains LoRA adapters with peft on chat data
(`hybridmoe finetune`; chat_data.py reads and labels it, lora_targets.py picks the layers, training.py,
train_checkpoint.py and train_progress.py run the loop).
"""

from hybridmoe.hf.offload import offload_experts
from hybridmoe.hf.offloaded_experts import OffloadedExperts
from hybridmoe.hf.pretrained import from_pretrained

__all__ = ["OffloadedExperts", "from_pretrained", "offload_experts"]
