"""The three ways `finetune.py sft` loads one checkpoint for LoRA training, each a function of (model_dir, device,
options) -> (model, note), the note saying how the setup ran where it differs from its name:

    hybridmoe    hybridmoe.hf.from_pretrained: the routed experts packed into the native CPU engine, the rest moved
                 to the device (what `hybridmoe finetune` trains)
    accelerate   transformers' from_pretrained with a device_map that puts every routed-experts module on "cpu" and
                 the rest on the GPU: accelerate's hooks copy each experts module's weights to the GPU for its forward
                 and drop the module's hold on them after (the usual way to train a model larger than the GPU); the
                 gradient of the experts' input reads those weights, so autograd keeps each layer's copy on the GPU
                 until the backward has passed it
    gpu          transformers' from_pretrained with everything on the device

On the CPU (the smoke run) the accelerate setup has no GPU to offload from: its model loads on the CPU and
accelerate's cpu_offload hooks wrap each experts module, so the same hooks load and drop the weights each forward,
with nothing to cross. The LoRA adapters go on the attention projections of all three (lora_targets.py).
"""

from __future__ import annotations

import torch

from hybridmoe.hf.family_layouts import family_of
from hybridmoe.hf.lora_targets import lora_target_modules


def load_hybridmoe(model_dir: str, device: torch.device, options: dict):
    from hybridmoe.hf import from_pretrained

    model = from_pretrained(model_dir, torch_dtype="auto", expert_format=options["expert_format"],
                            cpu_threads=options.get("cpu_threads"))
    return model.to(device), f"experts {options['expert_format']} in the CPU engine"


def load_accelerate(model_dir: str, device: torch.device, options: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    experts_class = family_of(config, model_dir).experts_class
    kwargs = transformers_kwargs(options)
    if device.type == "cpu":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", **kwargs)
        offloaded = wrap_experts_in_cpu_offload(model, experts_class)
        return model, (f"CPU smoke: accelerate's cpu_offload hooks on {offloaded} experts modules, executing on the "
                       f"CPU; {experts_note(model)}")
    device_map = experts_on_cpu_device_map(empty_model(config), experts_class, device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", device_map=device_map, **kwargs)
    offloaded = sum(1 for place in device_map.values() if place == "cpu")
    return model, f"device_map: {offloaded} experts modules on cpu; {experts_note(model)}"


def load_gpu(model_dir: str, device: torch.device, options: dict):
    from transformers import AutoModelForCausalLM

    on_gpu = device.type != "cpu"
    placement = {"device_map": {"": gpu_index(device)}} if on_gpu else {}  # read straight onto the GPU, no CPU copy first
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", **placement, **transformers_kwargs(options))
    where = f"all on {device}" if on_gpu else "CPU smoke: all on the CPU"
    return model, f"{where}; {experts_note(model)}"


LOADERS = {"hybridmoe": load_hybridmoe, "accelerate": load_accelerate, "gpu": load_gpu}


def transformers_kwargs(options: dict) -> dict:
    """The experts implementation where --experts-implementation names one (default: transformers' choice)."""
    implementation = options.get("experts_implementation")
    return {"experts_implementation": implementation} if implementation else {}


def experts_note(model) -> str:
    return f"transformers' experts_implementation {getattr(model.config, '_experts_implementation', None)}"


def empty_model(config):
    """The model of this config with its parameters on the meta device: its module names, nothing allocated."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def experts_on_cpu_device_map(model, experts_class: str, device: torch.device) -> dict[str, str | int]:
    """A device_map for transformers' from_pretrained that places every module of class experts_class (transformers
    5's fused routed experts, e.g. model.layers.N.mlp.experts) on "cpu" and everything else on `device`.

    The keys cover the model without overlap, as accelerate's dispatch needs: a module with no experts inside it
    is one key; one that holds experts contributes its own parameters and buffers one by one and its children
    each by these rules (a key "" would place the whole model on one device)."""
    experts = {name for name, module in model.named_modules() if type(module).__name__ == experts_class}
    if not experts:
        raise ValueError(f"{type(model).__name__} holds no {experts_class} module to offload")
    gpu = gpu_index(device)
    device_map: dict[str, str | int] = {}

    def place(name: str, module: torch.nn.Module) -> None:
        holds_experts = not name or any(e.startswith(name + ".") for e in experts)
        if name in experts:
            device_map[name] = "cpu"
        elif not holds_experts:
            device_map[name] = gpu
        else:
            prefix = f"{name}." if name else ""
            for own, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                device_map[prefix + own] = gpu
            for child_name, child in module.named_children():
                place(prefix + child_name, child)

    place("", model)
    return device_map


def gpu_index(device: torch.device) -> int:
    """The GPU's ordinal as a device_map names it ("cuda" is GPU 0)."""
    return device.index if device.index is not None else 0


def wrap_experts_in_cpu_offload(model, experts_class: str) -> int:
    """accelerate's cpu_offload hooks on each experts module, executing on the CPU; how many modules."""
    from accelerate import cpu_offload

    modules = [module for module in model.modules() if type(module).__name__ == experts_class]
    for module in modules:
        cpu_offload(module, execution_device=torch.device("cpu"))
    return len(modules)


def with_lora(model, rank: int, seed: int):
    """model wrapped by peft with LoRA adapters of this rank (alpha 2 * rank) on its attention projections; the
    adapters' A matrices drawn from seed, so every setup starts from the same adapter."""
    from peft import LoraConfig, get_peft_model

    model.config.use_cache = False
    targets = lora_target_modules("attention", model)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    return get_peft_model(model, config), targets
