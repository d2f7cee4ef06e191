"""Long context and prefix reuse on one engine: decode speed at each context length, the time to first token
of a conversation re-sent with new tokens against its cold one, and the most context a GPU budget holds.

    python3 benchmarks/context.py decode [--synthetic qwen3-30b-a3b] [--layers 4] [--contexts 1024,8192,32768,131072]
    python3 benchmarks/context.py prefix [--synthetic ...] [--context 32768] [--new-tokens 200]
    python3 benchmarks/context.py fit [--presets qwen3-30b-a3b,deepseek-v3] [--budget 24GiB]

decode: one engine whose KV cache holds the longest context; per context a random prompt of that many tokens
is prefilled (chunked as the engine does) and --gen-len tokens decoded greedily (its prefill tok/s; the decode
captures the CUDA graphs of that length), then the same request again (its prompt from the prefix cache), whose
decode steps alone are timed (from the first token to the last); each context's ratio is to the shortest one's.
prefix: the same engine, prefix caching on; the time to first token of a --context-token prompt from an empty
cache (cold), then of the same prompt with --new-tokens more (warm: its full blocks come from the cache); the
ratio warm / cold; with a host tier, once more after another prompt as long has evicted its blocks there. fit: per preset at full depth, what the budget leaves after the non-expert weights and the
workspace, as KV-cache tokens (no routed expert on the GPU). fp8: the float8 cache's accuracy, teacher-forced:
one random --tokens prompt through the cut model with an unquantized cache and with the float8 one, the share
of positions whose top token agrees and the KL divergence of the float8 run's next-token distribution from
the other's, and both caches' bytes per token. Figures of a cut model are per its depth.
"""

from __future__ import annotations

import time

import torch

from hybridmoe import SamplingParams
from hybridmoe.bench.synthetic import full_config, synthetic_checkpoint
from hybridmoe.config import EngineConfig, format_bytes, parse_bytes
from hybridmoe.engine.llm_engine import LLMEngine

from .cli import int_list, str_list, write_json

def add_arguments(parser) -> None:
    parser.add_argument("--synthetic", default="qwen3-30b-a3b", help="make-model preset (decode, prefix)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the cut model (default 4)")
    parser.add_argument("--format", default="int4", help="routed experts' format (default int4)")
    parser.add_argument("--contexts", default="1024,8192,32768,131072")
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--context", type=int, default=32768, help="prefix: the conversation's tokens")
    parser.add_argument("--new-tokens", type=int, default=200, help="prefix: the tokens the re-sent one adds")
    parser.add_argument("--device", default=None, help="default cuda when there is one, else cpu")
    parser.add_argument("--gpu-memory-budget", default=None, help="e.g. 16GiB (routed experts on the GPU)")
    parser.add_argument("--presets", default="qwen3-30b-a3b,deepseek-v3", help="fit: make-model presets")
    parser.add_argument("--budget", default="24GiB", help="fit: the GPU budget")
    parser.add_argument("--tokens", type=int, default=1024, help="fp8: the prompt's tokens")


def _engine(model_dir: str, args, max_len: int) -> LLMEngine:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return LLMEngine(model_dir, EngineConfig(device=device, expert_format=args.format, max_num_seqs=1,
                                             max_model_len=max_len, gpu_memory_budget=args.gpu_memory_budget))


def _timed(engine: LLMEngine, prompt: list[int], gen_len: int) -> tuple[float, float]:
    """(seconds to the first token, seconds per decoded token after it), greedy, EOS ignored."""
    start, first, tokens = time.perf_counter(), None, 0
    engine.add_request(prompt, SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
        if first is None and tokens:
            first = time.perf_counter()
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return first - start, (time.perf_counter() - first) / max(tokens - 1, 1)


def _prompt(engine: LLMEngine, n: int, seed: int) -> list[int]:
    return torch.randint(0, engine.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_rows(engine: LLMEngine, contexts: list[int], gen_len: int) -> list[dict]:
    _timed(engine, _prompt(engine, 64, 0), 8)  # warm-up: graphs, kernels
    rows = []
    for i, n in enumerate(contexts):
        prompt = _prompt(engine, n, 1 + i)
        ttft, _ = _timed(engine, prompt, gen_len)  # cold: its TTFT; its decode captures this length's graphs
        _, per_token = _timed(engine, prompt, gen_len)  # again, the prompt from the cache: decode alone timed
        rows.append({"context": n, "ttft_s": ttft, "decode_tok_s": 1 / per_token})
        print(f"context {n:>7}: decode {1 / per_token:8.1f} tok/s ({rows[-1]['decode_tok_s'] / rows[0]['decode_tok_s']:.2f}x "
              f"of {contexts[0]}), prefill {n / ttft:8.0f} tok/s", flush=True)
    return rows


def prefix_row(engine: LLMEngine, context: int, new_tokens: int) -> dict:
    _timed(engine, _prompt(engine, 64, 0), 2)
    conversation = _prompt(engine, context, 1)
    cold, _ = _timed(engine, conversation, 1)
    warm, _ = _timed(engine, conversation + _prompt(engine, new_tokens, 2), 1)
    hits = engine.scheduler.pool.stats.hit_tokens
    row = {"context": context, "new_tokens": new_tokens, "cold_ttft_s": cold, "warm_ttft_s": warm,
           "ratio": warm / cold, "hit_tokens": hits}
    print(f"{context} tokens cold: TTFT {cold * 1e3:.1f} ms; re-sent with {new_tokens} more: {warm * 1e3:.1f} ms "
          f"({warm / cold:.1%} of cold; {hits} tokens from the cache)", flush=True)
    if engine.kv_plan.host_blocks:  # another conversation evicts this one's blocks to the host tier
        _timed(engine, _prompt(engine, context + new_tokens, 3), 1)
        host, _ = _timed(engine, conversation + _prompt(engine, new_tokens, 4), 1)
        came = engine.scheduler.pool.stats.hit_tokens - hits
        row.update(host_ttft_s=host, host_ratio=host / cold, host_hit_tokens=came)
        print(f"re-sent after its blocks went to the host tier: {host * 1e3:.1f} ms ({host / cold:.1%} of cold; "
              f"{came} tokens from the cache)", flush=True)
    return row


def fit_rows(presets: list[str], budget: int) -> list[dict]:
    from hybridmoe.experts.placement import model_footprint
    from hybridmoe.models.registry import get_model_class

    rows = []
    for preset in presets:
        raw = full_config(preset)
        cls = get_model_class(raw["architectures"][0])
        fp, fp8 = (model_footprint(cls, cls.make_config(raw), torch.bfloat16,
                                   EngineConfig(max_num_seqs=1, kv_cache_dtype=dtype)) for dtype in ("auto", "fp8"))
        left = max(budget - fp.non_expert_bytes - fp.workspace_bytes, 0)
        tokens, tokens_fp8 = left // fp.kv_plan.bytes_per_token, left // fp8.kv_plan.bytes_per_token
        rows.append({"preset": preset, "non_expert_bytes": fp.non_expert_bytes, "workspace_bytes": fp.workspace_bytes,
                     "kv_bytes_per_token": fp.kv_plan.bytes_per_token, "context_tokens": tokens,
                     "fp8_kv_bytes_per_token": fp8.kv_plan.bytes_per_token, "fp8_context_tokens": tokens_fp8})
        print(f"{preset}: {format_bytes(budget)} - non-expert weights {format_bytes(fp.non_expert_bytes)} - "
              f"workspace {format_bytes(fp.workspace_bytes)} = {format_bytes(left)} of KV cache at "
              f"{format_bytes(fp.kv_plan.bytes_per_token)} per token: {tokens} tokens of context "
              f"({tokens_fp8} with --kv-cache-dtype fp8)", flush=True)
    return rows


def fp8_row(model_dir: str, args) -> dict:
    from hybridmoe.engine.model_loader import load_model
    from hybridmoe.forward_context import single_sequence_context, use_context

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(model_dir, EngineConfig(device=device, expert_format=args.format)).model
    ids = torch.randint(0, model.config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for quantized in (False, True):
        model.allocate_kv_cache(1, args.tokens, quantized=quantized)
        with torch.inference_mode(), use_context(single_sequence_context(args.tokens)):
            logits[quantized] = model.compute_logits(model(ids.to(device), torch.arange(args.tokens, device=device)))
    exact, fp8 = logits[False].float(), logits[True].float()
    kl = torch.nn.functional.kl_div(fp8.log_softmax(-1), exact.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    row = {"tokens": args.tokens, "top1_agreement": (exact.argmax(-1) == fp8.argmax(-1)).float().mean().item(),
           "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
           "bytes_per_token": model.kv_bytes_per_token(), "fp8_bytes_per_token": model.kv_bytes_per_token(True)}
    print(f"fp8 KV cache over {args.tokens} tokens: top token agrees at {row['top1_agreement']:.2%} of positions, "
          f"KL mean {row['kl_mean']:.5f} max {row['kl_max']:.4f}; {row['fp8_bytes_per_token']} bytes per token "
          f"against {row['bytes_per_token']}", flush=True)
    return row


def run(args) -> int:
    if args.command == "fit":
        write_json(args.json, {"budget": parse_bytes(args.budget), "rows": fit_rows(str_list(args.presets),
                                                                                   parse_bytes(args.budget))})
        return 0
    if args.command == "fp8":
        with synthetic_checkpoint(args.synthetic, args.layers) as ckpt:
            write_json(args.json, {"synthetic": args.synthetic, "layers": args.layers,
                                   "result": fp8_row(str(ckpt.out_dir), args)})
        return 0
    contexts = int_list(args.contexts)
    longest = max(contexts) + args.gen_len if args.command == "decode" else args.context + args.new_tokens + 1
    with synthetic_checkpoint(args.synthetic, args.layers) as ckpt:
        engine = _engine(str(ckpt.out_dir), args, longest)
        print(f"# {args.synthetic} cut to {args.layers} layers, {args.format} experts, device "
              f"{engine.runner.device}; kv cache: {engine.kv_plan.line()}", flush=True)
        result = (decode_rows(engine, contexts, args.gen_len) if args.command == "decode"
                  else prefix_row(engine, args.context, args.new_tokens))
    write_json(args.json, {"synthetic": args.synthetic, "layers": args.layers, "format": args.format,
                           "result": result})
    return 0
