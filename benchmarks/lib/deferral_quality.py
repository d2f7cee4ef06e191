"""What expert deferral costs in accuracy: next-token distributions with K deferred experts vs K=0.

    python3 benchmarks/quality.py deferral --model DIR [--model DIR ...] [--ks 1,2,3] [--prompts 4]
        [--prompt-len 64] [--json F]
    python3 benchmarks/quality.py deferral --synthetic qwen3-30b-a3b --layers 4 [...]

For each model, random token prompts are prefilled once per K (teacher forcing: every position
sees the same tokens), and at every position we compare the next-token distribution p_K with p_0:
mean KL(p_0 || p_K) in nats, and greedy agreement = the share of positions whose argmax is the
same. Each model is loaded once (the torch reference experts, all on the CPU, float32 for fp32
checkpoints) and K is switched on the same backend (K=0 is bit-identical to no deferral: tested
in tests/hybrid/test_deferral.py). K values at or above the model's experts per token are skipped.
Synthetic checkpoints (random weights) from `hybridmoe make-model` are what this measures by
default; their next-token distributions are nearly flat (the table's "p0 top-1": mean probability
of p_0's argmax), so greedy agreement there mostly measures near-ties; KL is the steadier figure, and
a trained model's numbers will differ. --synthetic writes such a checkpoint of a make-model preset
(cut to --layers) into memory for the run (hybridmoe/bench/synthetic.py) and measures it like a --model.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hybridmoe.bench.prompts import add_arguments as add_prompt_arguments
from hybridmoe.bench.prompts import load_reference, measure_each, random_prompts, results_json
from hybridmoe.forward_context import single_sequence_context, use_context

from .cli import int_list, write_json


def add_arguments(parser):
    add_prompt_arguments(parser)
    parser.add_argument("--ks", default="1,2,3", help="deferred experts per token to measure (default 1,2,3)")


@torch.inference_mode()
def log_probs(model, ids: list[int]) -> torch.Tensor:
    """[T, V] float32 next-token log-probabilities of one prompt prefilled from position 0."""
    with use_context(single_sequence_context(len(ids))):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
    return torch.log_softmax(model.compute_logits(hidden), dim=-1)


def measure(model_dir: str, ks: list[int], args) -> list[dict]:
    loaded = load_reference(model_dir, args)
    model, experts, config = loaded.model, loaded.experts, loaded.config
    prompts = random_prompts(config.vocab_size, args)
    experts.deferred_experts = 0
    exact = [log_probs(model, p) for p in prompts]
    # how peaked p_0 is: random-weight models are nearly flat, so their argmax flips on tiny changes
    top1 = float(torch.cat([ref.exp().max(-1).values for ref in exact]).mean())
    rows = []
    for k in ks:
        if k >= config.num_experts_per_tok:
            continue
        experts.deferred_experts = k
        start = time.perf_counter()
        kl, agree, n = 0.0, 0, 0
        for p, ref in zip(prompts, exact):
            got = log_probs(model, p)
            kl += float((ref.exp() * (ref - got)).sum())
            agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
            n += ref.shape[0]
        rows.append({"model": str(model_dir), "model_type": config.get("model_type"),
                     "layers": config.num_hidden_layers, "moe_layers": len(model.moe_layers),
                     "experts_per_token": config.num_experts_per_tok, "deferred_experts": k,
                     "mean_kl_nats": kl / n, "greedy_agreement": agree / n, "positions": n,
                     "mean_top1_prob_k0": top1,
                     "dtype": str(loaded.dtype).removeprefix("torch."),
                     "seconds": round(time.perf_counter() - start, 2)})
    return rows


def run(args) -> int:
    ks = int_list(args.ks)
    rows = measure_each(args, lambda model_dir: measure(model_dir, ks, args))
    print(f"{'model':<40} {'type':<12} {'layers':>6} {'top-k':>5} {'K':>2} {'mean KL (nats)':>15} "
          f"{'greedy agree':>12} {'p0 top-1':>8} {'positions':>9}")
    for r in rows:
        print(f"{Path(r['model']).name:<40} {r['model_type']:<12} {r['layers']:>6} {r['experts_per_token']:>5} "
              f"{r['deferred_experts']:>2} {r['mean_kl_nats']:>15.3e} {100 * r['greedy_agreement']:>11.1f}% "
              f"{r['mean_top1_prob_k0']:>8.1e} {r['positions']:>9}")
    write_json(args.json, results_json(args, rows))
    return 0
