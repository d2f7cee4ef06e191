"""Structured output's cost on one engine: decode with and without a JSON-schema grammar, and schema compilation.

    python3 benchmarks/structured.py decode [--synthetic qwen3-30b-a3b] [--layers 4] [--batches 1,8] [--gen-len 64]
    python3 benchmarks/structured.py compile [--model DIR | --synthetic ...] [--properties 200]

decode: per batch size B, B requests of a short random prompt decode --gen-len tokens each, greedy, free and
held to a JSON schema (an array of at least 4096 one-digit integers, so the grammar never ends before
--gen-len and both decode the same number of tokens), three times each, interleaved; the median decode tok/s of
each (all B sequences' tokens from the first token to the last, after a warm-up run of the same shape), the ratio
held / free, and the mask's own time
per step (Grammars.mask, on the logits' device, over the same B matchers, timed alone). compile: a schema of
--properties properties (strings with patterns, integers with ranges, enums, nested objects, arrays) checked and
turned into a matcher, and its first mask computed: each step's seconds. Figures of a cut model are per its depth.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from hybridmoe import SamplingParams
from hybridmoe.bench.synthetic import synthetic_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.sampling_params import StructuredOutput

from .cli import int_list, write_json

DIGITS = StructuredOutput("json_schema", json.dumps({"type": "array", "minItems": 4096,
                                                     "items": {"type": "integer", "minimum": 0, "maximum": 9}}))


REPEATS = 3


def add_arguments(parser) -> None:
    parser.add_argument("--synthetic", default="qwen3-30b-a3b", help="make-model preset")
    parser.add_argument("--model", default=None, help="compile: a model directory instead of --synthetic")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the cut model (default 4)")
    parser.add_argument("--format", default="int4", help="routed experts' format (default int4)")
    parser.add_argument("--group-size", type=int, default=None, help="int4 group size (default the engine's)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--properties", type=int, default=200, help="compile: the schema's properties")
    parser.add_argument("--device", default=None, help="default cuda when there is one, else cpu")
    parser.add_argument("--gpu-memory-budget", default=None, help="e.g. 16GiB (routed experts on the GPU)")


def _decode_tok_s(engine: LLMEngine, batch: int, gen_len: int, structured: StructuredOutput | None) -> float:
    """All sequences' tokens per second from the first token to the last (greedy, EOS ignored)."""
    for i in range(batch):
        prompt = torch.randint(0, engine.vocab_size, (16,), generator=torch.Generator().manual_seed(i)).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True,
                                                  structured=structured))
    first, tokens = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                raise RuntimeError(out.error)
            tokens += len(out.new_token_ids)
        if first is None and tokens:
            first, tokens = time.perf_counter(), 0
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - first)


def _mask_ms(engine: LLMEngine, batch: int, steps: int = 50) -> float:
    """Grammars.mask's ms per step over `batch` DIGITS matchers, on logits of the engine's device."""
    grammars = engine.grammars()
    matchers = [(i, grammars.matcher(DIGITS)) for i in range(batch)]
    logits = torch.zeros(batch, engine.vocab_size, device=engine.runner.device)
    digit = engine.tokenizer.encode("[", add_special_tokens=False)[0]
    for _, m in matchers:
        m.consume_token(digit)
    grammars.mask(logits, matchers)
    start = time.perf_counter()
    for _ in range(steps):
        grammars.mask(logits, matchers)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def decode_rows(engine: LLMEngine, batches: list[int], gen_len: int) -> list[dict]:
    rows = []
    for b in batches:
        for structured in (None, DIGITS):  # warm-up of this shape, each way
            _decode_tok_s(engine, b, 8, structured)
        runs = {None: [], DIGITS: []}
        for _ in range(REPEATS):  # interleaved, so that a drift of the host shows in both
            for structured in runs:
                runs[structured].append(_decode_tok_s(engine, b, gen_len, structured))
        free, held = statistics.median(runs[None]), statistics.median(runs[DIGITS])
        rows.append({"batch": b, "free_tok_s": free, "json_schema_tok_s": held, "ratio": held / free,
                     "mask_ms_per_step": _mask_ms(engine, b)})
    return rows


def large_schema(properties: int) -> dict:
    kinds = [{"type": "string", "pattern": "^[a-z]{2,8}-[0-9]{1,4}$"},
             {"type": "integer", "minimum": -1000, "maximum": 100000},
             {"enum": ["alpha", "beta", "gamma", "delta"]},
             {"type": "object", "properties": {"x": {"type": "number"}, "tags": {"type": "array", "items":
                                                                                  {"type": "string"}}},
              "required": ["x"]},
             {"type": "array", "items": {"type": "boolean"}, "maxItems": 5}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(properties)}
    return {"type": "object", "properties": props, "required": list(props)[: properties // 2],
            "additionalProperties": False}


def compile_row(engine: LLMEngine, properties: int) -> dict:
    spec = StructuredOutput("json_schema", json.dumps(large_schema(properties)))
    t0 = time.perf_counter()
    grammars = engine.grammars()
    t1 = time.perf_counter()
    grammars.check(spec)
    t2 = time.perf_counter()
    matcher = grammars.matcher(spec)
    t3 = time.perf_counter()
    grammars.mask(torch.zeros(1, engine.vocab_size), [(0, matcher)])
    t4 = time.perf_counter()
    return {"properties": properties, "schema_chars": len(spec.spec), "vocabulary_s": t1 - t0, "check_s": t2 - t1,
            "matcher_s": t3 - t2, "first_mask_s": t4 - t3}


def run(args) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = dict(device=device, expert_format=args.format, gpu_memory_budget=args.gpu_memory_budget,
                  **({"expert_group_size": args.group_size} if args.group_size else {}),
                  max_num_seqs=max(int_list(args.batches)), max_model_len=16 + args.gen_len + 8)
    if args.command == "compile" and args.model:
        result = compile_row(LLMEngine(args.model, EngineConfig(device=device, max_num_seqs=1)), args.properties)
    else:
        with synthetic_checkpoint(args.synthetic, args.layers) as ckpt:
            engine = LLMEngine(str(ckpt.out_dir), EngineConfig(**config))
            result = (decode_rows(engine, int_list(args.batches), args.gen_len) if args.command == "decode"
                      else compile_row(engine, args.properties))
    for row in result if isinstance(result, list) else [result]:
        print("  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    write_json(args.json, {"command": args.command, "device": device, "synthetic": args.synthetic,
                           "layers": args.layers, "rows": result})
    return 0
