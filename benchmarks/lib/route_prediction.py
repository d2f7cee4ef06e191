"""How well a MoE layer's experts can be known before its router runs: the top-k of layer L's router
applied to layer L's *input* (its post-attention norm of the residual before L's attention), against the
top-k it really routes to (the same router on the residual after L's attention).

    python3 benchmarks/quality.py route-prediction --model DIR [--model DIR ...] [--prompts 4] [--prompt-len 64]
        [--json F]
    python3 benchmarks/quality.py route-prediction --synthetic qwen3-30b-a3b --layers 8 [...]

Why: in a hybrid decode step the CPU waits while the GPU runs the next layer's attention and router (the e2e
anatomy's "gap"). Layer L's input exists as soon as layer L-1's experts are summed, so a router GEMV on it
could name the experts the CPU would prefetch while the attention runs. This measures that prediction: per
MoE layer, the share of each token's K routed experts that the prediction names (1.0: all of them; a random
guess gets K/E), over random token prompts prefilled once (teacher forcing), the torch reference experts on
the CPU. Synthetic checkpoints have random weights, so their residual stream moves more per layer than a
trained model's: their figures are what the engine's benchmarks run on, not what a trained model gives.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridmoe.bench.prompts import add_arguments as add_prompt_arguments
from hybridmoe.bench.prompts import load_reference, measure_each, random_prompts, results_json
from hybridmoe.forward_context import single_sequence_context, use_context
from hybridmoe.layers.router import softmax_topk
from hybridmoe.models.deepseek import DeepseekMoE
from hybridmoe.models.moe_block import SparseMoeBlock

from .cli import write_json


def add_arguments(parser):
    add_prompt_arguments(parser)


def routed_ids(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[T, K] expert ids the block's router picks for its normalized input x [T, H]."""
    if isinstance(block, DeepseekMoE):
        return block.gate(x, None)[0]
    if isinstance(block, SparseMoeBlock):
        return softmax_topk(block.gate(x), block.top_k, block.renormalize)[1]
    raise TypeError(f"no router known for {type(block).__name__}")


def overlap(predicted: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """[T] share of each token's actual experts that predicted [T, K] names too."""
    return (predicted.unsqueeze(-1) == actual.unsqueeze(-2)).any(-2).float().mean(-1)


@torch.inference_mode()
def prompt_overlaps(model, ids: list[int]) -> dict[int, torch.Tensor]:
    """MoE layer -> [T] overlap of the prediction from the layer's input with its routing, for one prompt."""
    layers = model.model.layers
    blocks = {i: getattr(layers[i], layers[i].mlp_name) for i in model.moe_layers}
    routed_inputs: dict[int, torch.Tensor] = {}
    hooks = [block.register_forward_pre_hook(lambda _m, args, i=i: routed_inputs.__setitem__(i, args[0]))
             for i, block in blocks.items()]
    inputs: list[torch.Tensor] = []  # the embeddings, then each decoder layer's output: layer i's input is [i]
    try:
        with use_context(single_sequence_context(len(ids))):
            model(torch.tensor(ids), torch.arange(len(ids)), hidden_states_out=inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return {i: overlap(routed_ids(block, layers[i].post_attention_layernorm(inputs[i])),
                       routed_ids(block, routed_inputs[i]))
            for i, block in blocks.items()}


def measure(model_dir: str, args) -> dict:
    loaded = load_reference(model_dir, args)
    model, config = loaded.model, loaded.config
    per_layer: dict[int, list[torch.Tensor]] = {}
    for prompt in random_prompts(config.vocab_size, args):
        for layer, share in prompt_overlaps(model, prompt).items():
            per_layer.setdefault(layer, []).append(share)
    shares = {layer: float(torch.cat(v).mean()) for layer, v in per_layer.items()}
    experts, top_k = model.expert_dims()[0], config.num_experts_per_tok
    return {"model": str(model_dir), "model_type": config.get("model_type"), "layers": config.num_hidden_layers,
            "experts": experts, "experts_per_token": top_k, "random_guess": top_k / experts,
            "mean_overlap": sum(shares.values()) / len(shares), "per_layer": shares,
            "positions": args.prompts * args.prompt_len, "dtype": str(loaded.dtype).removeprefix("torch.")}


def run(args) -> int:
    rows = measure_each(args, lambda model_dir: [measure(model_dir, args)])
    print(f"{'model':<40} {'type':<12} {'layers':>6} {'E':>4} {'top-k':>5} {'predicted':>9} {'random':>7} "
          f"{'positions':>9}  per MoE layer")
    for r in rows:
        layers = " ".join(f"{100 * s:.0f}" for s in r["per_layer"].values())
        print(f"{Path(r['model']).name:<40} {r['model_type']:<12} {r['layers']:>6} {r['experts']:>4} "
              f"{r['experts_per_token']:>5} {100 * r['mean_overlap']:>8.1f}% {100 * r['random_guess']:>6.1f}% "
              f"{r['positions']:>9}  {layers}")
    write_json(args.json, results_json(args, rows))
    return 0
