"""Decode speed with K deferred experts per token, side by side: K switched on one loaded engine, interleaved.

    python3 benchmarks/decode.py deferral --synthetic qwen3-30b-a3b --layers 4,12 --formats int4,bf16
        [--ks 0,1,2,3] [--own-trim on,off] [--zero-copy off,on] | [--variants 0,1,2,0:notrim,0:nozc,0:kf]
        [--repeats 3] [--gen-len 32] [--decode-prompt-len 64] [--json F]
        [engine options: --device cuda --gpu-memory-budget 16GiB --gpu-experts-per-layer 26 ...]

For each depth (a synthetic checkpoint in memory, cut to that many layers) and expert format, one engine
is loaded; then, `repeats` rounds of: for each row (K deferred experts, and the handoffs' trim_padding
and zero_copy as given), HybridExperts.set_deferred_experts(K), the CUDA graphs dropped and captured
again by a warm-up decode, and gen_len tokens decoded greedily at batch 1 and timed (the first step,
the prompt, left out). Identical rows can differ between runs (docs/decisions.md), so the rows
are interleaved within each round and a row is the median of its rounds (every sample printed). "tokens =
first row" compares each row's greedy tokens with the first row's (rows with the same K must agree).
The floor is the CPU-resident expert bytes read per token (the routing of a K=0 decode) over the host
read bandwidth measured in this run; deferred experts are still read, so it is the same for every K.
With two or more depths (and every layer a MoE layer), decode time per token is also fitted as fixed +
per layer x layers and given at the preset's full depth.

On CUDA (stream_mem_ops handoff) each row also says what the handoffs' polling thread saw per step: for
the layers' own part and the deferred part apart, the CPU work per layer and the gap from one layer's
done to the next layer's go. Where a layer's own and deferred handoffs are linked (both parts in one call:
with HybridTuning.kernel_flags and zero_copy) the own part's work runs from its go to its output's done, the
deferred part's from there to the call's end, and the own gap from that done to the next go (the deferred
part's work included: the polling thread sees the next go only once the call has ended); "late" then counts
the deferred part too.
"""

from __future__ import annotations

import re
import statistics
import time
import traceback
from dataclasses import dataclass, replace

import torch

from hybridmoe.bench.anatomy import step_anatomy
from hybridmoe.bench.fit import fit_line
from hybridmoe.bench.floor import decode_floor, decode_routing
from hybridmoe.bench.synthetic import full_config, synthetic_checkpoint
from hybridmoe.commands.engine_args import add_engine_arguments, engine_kwargs
from hybridmoe.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.errors import HybridMoEError
from hybridmoe.system.bandwidth import floor_bandwidth, floor_bandwidth_method

from .cli import Stopped, int_list, str_list, write_json
from .common import decode_seconds
from .e2e import full_depth_gpu_experts


def add_arguments(parser):
    parser.add_argument("--synthetic", required=True, metavar="PRESET", help="a make-model preset, written to memory")
    parser.add_argument("--layers", default=None, help="decoder layers of the cut model(s), e.g. 4,12 (default: full)")
    parser.add_argument("--formats", default=None, help="expert formats, e.g. int4,bf16 (default: the engine's)")
    parser.add_argument("--ks", default="0,1,2,3", help="deferred experts per token (default 0,1,2,3)")
    parser.add_argument("--own-trim", default="on", help="on (the engine's default), off or on,off: the layers' own "
                        "handoffs leave one token's padding slots out (CudaHandoff.trim_padding; the deferred ones "
                        "always do)")
    parser.add_argument("--zero-copy", default=None, help="off, on or off,on: every handoff stages its rows and "
                        "hands its output back through the device's mapping of its pinned buffers (CudaHandoff.zero_copy; "
                        "default: the engine's, HybridTuning.zero_copy)")
    parser.add_argument("--variants", help="instead of --ks x --own-trim x --zero-copy, these rows: comma-separated "
                        "K[:notrim][:zc|:nozc][:nopin][:kf|:nokf][:res|:nores][:gut|:nogut][:hw|:nohw][:ibN] "
                        "(zc/nozc: "
                        "zero-copy on/off, else the engine's; nopin: the decode steps' thread left unpinned, "
                        "HybridTuning.pin_decode_thread; "
                        "kf/nokf: the router's kernel stages the CPU's rows and kernels play the handoff's flags, "
                        "HybridTuning.kernel_flags; res/nores: the MoE blocks hand the residual add to the "
                        "backend, SparseMoeBlock.adds_residual; gut/nogut: every handoff's CPU "
                        "work cuts its last gate/up items into 1-block items; ibN: GEMM items of N blocks (0: "
                        "automatic); both EngineTuning's, through "
                        "CudaHandoff.tune; hw/nohw: the decode thread works in the layers' pool while it waits "
                        "for its step, HybridTuning.help_decode_wait; else the engine's), "
                        "e.g. 0,1,2,0:nozc,0:nopin,0:kf")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the rows (default 3)")
    parser.add_argument("--gen-len", type=int, default=32, help="tokens decoded per sample (default 32)")
    parser.add_argument("--decode-prompt-len", type=int, default=64)
    parser.add_argument("--bandwidth-bytes", type=int, default=4 << 30, help="host read probe size (default 4 GiB, as e2e)")
    parser.add_argument("--seed", type=int, default=0)
    add_engine_arguments(parser)


def _switches(text: str) -> list[bool]:
    return [{"off": False, "on": True}[t.strip()] for t in text.split(",")]


START = time.perf_counter()


@dataclass(frozen=True)
class Variant:
    k: int
    """Deferred experts per token."""
    own_trim: bool
    zero_copy: bool | None
    """Every handoff's CudaHandoff.zero_copy; None: the engine's (HybridTuning.zero_copy)."""
    pin: bool = True
    """The decode steps' thread pinned off the handoff pools' CPUs (HybridTuning.pin_decode_thread)."""
    kernel_flags: bool | None = None
    """HybridTuning.kernel_flags; None: the engine's."""
    residual: bool | None = None
    """Every MoE block's adds_residual (models/moe_block.py); None: the model's."""
    gate_up_tail: bool | None = None
    """Every handoff's EngineTuning.gate_up_tail (CudaHandoff.tune); None: the engine's."""
    item_blocks: int | None = None
    """Every handoff's EngineTuning.item_blocks (CudaHandoff.tune; 0: automatic); None: the engine's."""
    help_wait: bool | None = None
    """HybridTuning.help_decode_wait; None: the engine's."""

    def label(self) -> str:
        copies = {None: "", True: " zero-copy", False: " copies"}[self.zero_copy]
        return (f"K={self.k}" + ("" if self.own_trim else " own trim off") + copies
                + ("" if self.pin else " unpinned")
                + {None: "", True: " kernel flags", False: " stream flags"}[self.kernel_flags]
                + {None: "", True: " residual in the MoE", False: " residual added after"}[self.residual]
                + {None: "", True: " gate/up tail", False: " no gate/up tail"}[self.gate_up_tail]
                + ("" if self.item_blocks is None else f" {self.item_blocks}-block items")
                + {None: "", True: " helping wait", False: " spinning wait"}[self.help_wait])


def part_stats(model) -> dict[str, list]:
    """The stream_mem_ops handoffs of the model's hybrid experts: {"own": [...], "deferred": [...]}."""
    found = getattr(model.experts, "_handoffs", {})  # (deferred?, layer) -> (CudaHandoff, width)
    parts: dict[str, dict] = {"own": {}, "deferred": {}}
    for (deferred, _), (handoff, _) in found.items():
        if handoff.path == "stream_mem_ops":
            parts["deferred" if deferred else "own"][id(handoff)] = handoff
    return {name: list(hs.values()) for name, hs in parts.items()}


def anatomy(parts: dict[str, list]) -> dict[str, dict]:
    """Per part: layers served per step, CPU us per layer, gap us (done -> next go seen), poller lateness
    (hybridmoe.bench.anatomy.step_anatomy of the part's handoffs; a part that served no step left out)."""
    out = {}
    for name, hs in parts.items():
        stats = [h.take_stats() for h in hs]
        a = step_anatomy(stats, 0.0)  # (the step time is not used here)
        if a is not None:
            out[name] = {"layers_per_step": a.layers_per_step, "cpu_us": a.cpu_us, "gap_us": a.gap_us,
                         "late_us": a.late_us, "first_cpu_us": a.first_cpu_us, "first_late_us": a.first_late_us,
                         "late_max_us": max(s["late_max_us"] for s in stats),
                         "slow_lates": sum(s["slow_lates"] for s in stats) / a.steps,
                         "cpu_max_us": max(s["cpu_max_us"] for s in stats)}
    return out


def _variant(spec: str) -> Variant:
    """"K[:notrim][:zc|:nozc][:nopin][:kf|:nokf][:res|:nores][:gut|:nogut][:hw|:nohw][:ibN]" -> Variant."""
    k, *opts = spec.strip().split(":")
    switches = ("zc", "kf", "res", "gut", "hw")
    blocks = [o for o in opts if re.fullmatch(r"ib\d+", o)]
    unknown = set(opts) - set(blocks) - {"notrim", "nopin"} - {s for on in switches for s in (on, "no" + on)}
    if unknown or len(blocks) > 1 or any({on, "no" + on} <= set(opts) for on in switches):
        raise HybridMoEError(f"--variants: unknown or contradicting option(s) in {spec!r} "
                             "(notrim, nopin, one ibN, and one of zc/nozc, kf/nokf, res/nores, gut/nogut, "
                             "hw/nohw each)")

    def switch(on: str) -> bool | None:
        return True if on in opts else False if "no" + on in opts else None
    return Variant(int(k), "notrim" not in opts, switch("zc"), "nopin" not in opts, switch("kf"), switch("res"),
                   switch("gut"), int(blocks[0][2:]) if blocks else None, switch("hw"))


def measure_engine(engine, variants: list[Variant], args, bandwidth: float, method: str) -> list[dict]:
    """Each variant measured `repeats` times, the variants interleaved within each round."""
    model = engine.runner.model
    experts = model.experts
    if not hasattr(experts, "set_deferred_experts"):
        raise HybridMoEError(f"the model's experts ({type(experts).__name__}) are not the hybrid split; "
                             "give a GPU budget or --gpu-experts-per-layer")
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, engine.vocab_size, (args.decode_prompt_len,), generator=g).tolist()
    floor = decode_floor(model, bandwidth, method, decode_routing(engine, prompt, args.gen_len))
    samples = {v: [] for v in variants}
    parts_seen = {v: [] for v in variants}
    tokens = {}
    stopped = False
    try:
        rounds(engine, variants, args, prompt, samples, parts_seen, tokens)
    except Stopped:
        stopped = True
        print("  stopped (SIGTERM): the rows below are the samples measured so far", flush=True)
    rows = []
    for v in variants:
        if not samples[v]:
            continue
        s = statistics.median(samples[v])
        same = sum(a == b for a, b in zip(tokens[v], tokens[variants[0]]))
        rows.append({"variant": v, "deferred_experts": v.k, "own_trim": v.own_trim, "zero_copy": v.zero_copy,
                     "decode_s": s, "decode_tok_s": 1 / s, "samples_s": samples[v], "floor_s": floor.seconds,
                     "decode_over_floor": s / floor.seconds if floor.seconds else None,
                     "tokens_equal_to_first_row": f"{same}/{len(tokens[v])}", "anatomy": parts_seen[v]})
    return rows, stopped


def rounds(engine, variants: list[Variant], args, prompt: list[int], samples: dict, parts_seen: dict,
           tokens: dict) -> None:
    model = engine.runner.model
    experts = model.experts
    failed: set[Variant] = set()
    for round_ in range(args.repeats):
        # each round starts one row later (A B C, B C A, ...): a fixed order cannot tell a first-row bias apart
        for v in variants[round_ % len(variants):] + variants[:round_ % len(variants)]:
            if v in failed:
                continue
            try:
                seconds, toks, seen = sample(engine, experts, v, prompt, args.gen_len)
            except Exception as e:  # noqa: BLE001 (one variant's failure must not lose the others' rows)
                traceback.print_exc()
                print(f"    {v.label()}: FAILED ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})", flush=True)
                failed.add(v)
                continue
            samples[v].append(seconds)
            parts_seen[v].append(seen)
            tokens.setdefault(v, toks)
            print(f"    round {round_ + 1} {v.label()}: {1 / seconds:.1f} tok/s ({seconds * 1e3:.3f} ms/token) "
                  f"{_anatomy_line(seen)} (+{time.perf_counter() - START:.0f} s)", flush=True)


RETIRED: list = []
"""Graphs captured for earlier rows, never replayed again but kept alive: the runner captures every graph
into one memory pool, and capturing into a pool whose graphs were all freed fails inside torch's allocator
(use_count > 0); hybridmoe/bench/suite.py keeps its own retired graphs for the same reason."""


def sample(engine, experts, v: Variant, prompt: list[int], gen_len: int) -> tuple[float, list[int], dict]:
    """One timed decode with variant v: seconds per token, the tokens, the handoffs' anatomy."""
    if engine.runner.fixed:  # the graphs captured for the previous K are not replayed again (new handoffs)
        torch.cuda.synchronize()
        RETIRED.extend(engine.runner._graphs.values())
        engine.runner._graphs.clear()
    # before the handoffs are made again: use_fixed_shapes links them by kernel_flags
    if v.kernel_flags is not None:
        experts.tuning.kernel_flags = v.kernel_flags
    experts.set_deferred_experts(v.k)
    parts = part_stats(engine.runner.model)
    for h in parts["own"]:
        h.trim_padding = v.own_trim
    knobs = {name: on for name, on in (("gate_up_tail", v.gate_up_tail), ("item_blocks", v.item_blocks))
             if on is not None}
    for h in parts["own"] + parts["deferred"]:
        if v.zero_copy is not None:
            h.zero_copy = v.zero_copy
        if knobs:
            h.tune(replace(h.tuning, **knobs))
    experts.tuning.pin_decode_thread = v.pin
    if v.help_wait is not None:
        experts.tuning.help_decode_wait = v.help_wait
    for layer in engine.runner.model.model.layers:
        mlp = getattr(layer, layer.mlp_name)
        if v.residual is not None and hasattr(mlp, "adds_residual"):
            mlp.adds_residual = v.residual
    decode_seconds(engine, prompt, 4)  # captures the graph(s) for this K
    anatomy(parts)  # zero the counters
    seconds, toks = decode_seconds(engine, prompt, gen_len)
    return seconds, toks, anatomy(parts)


def _median_of(row: dict, part: str, key: str) -> str:
    """The median over a row's samples of one anatomy figure, "-" where none was seen."""
    seen = [a[part][key] for a in row["anatomy"] if part in a and a[part][key] is not None]
    return f"{statistics.median(seen):.1f}" if seen else "-"


def _anatomy_line(a: dict) -> str:
    return " ".join(f"[{name}: {v['layers_per_step']:.0f} layers/step, CPU {v['cpu_us']:.1f} us/layer (first "
                    f"{v['first_cpu_us']:.1f}), gap {v['gap_us'] or 0:.1f} us, late "
                    f"{v['late_us']:.1f} us (first {v['first_late_us']:.1f}, max {v['late_max_us']:.0f}, "
                    f"{v['slow_lates']:.2f}/step > 20 us), CPU max {v['cpu_max_us']:.0f} us]" for name, v in a.items())


def run(args) -> int:
    ks = int_list(args.ks)
    variants = ([_variant(spec) for spec in args.variants.split(",")] if args.variants else
                [Variant(k, trim, zc) for zc in (_switches(args.zero_copy) if args.zero_copy else [None])
                 for trim in _switches(args.own_trim)
                 for k in ks])
    depths = int_list(args.layers) if args.layers else [None]
    formats = str_list(args.formats) or [None]
    kwargs = engine_kwargs(args)
    kwargs.setdefault("max_num_seqs", 1)
    kwargs.setdefault("max_model_len", args.decode_prompt_len + args.gen_len)
    kwargs.setdefault("cache_dir", "")  # a throwaway model: nothing to keep packed on disk
    bandwidth, method = floor_bandwidth(args.bandwidth_bytes, kwargs.get("cpu_threads")), floor_bandwidth_method()
    print(f"host read bandwidth: {bandwidth / 1e9:.1f} GB/s ({method})", flush=True)
    full = full_config(args.synthetic)
    # a cut model gets the full model's GPU experts per layer under the budget (as e2e does): its own plan
    # would hold nearly every expert on the GPU (docs/decisions.md, "A cut model's GPU experts")
    if kwargs.get("gpu_memory_budget") is not None and "gpu_experts_per_layer" not in kwargs \
            and any(d is not None and d < full["num_hidden_layers"] for d in depths):
        kwargs["gpu_experts_per_layer"], note = full_depth_gpu_experts(
            full, {k: v for k, v in kwargs.items() if k != "cache_dir"})
        print(f"# {note}", flush=True)
    results, stopped = [], False
    for layers in depths:
        if stopped:
            break
        with synthetic_checkpoint(args.synthetic, layers, seed=args.seed) as synthetic:
            for fmt in formats:
                if stopped:
                    break
                options = dict(kwargs, **({"expert_format": fmt} if fmt else {}))
                t0 = time.perf_counter()
                engine = LLMEngine(str(synthetic.out_dir), EngineConfig.from_kwargs(**options))
                n = len(engine.runner.model.model.layers)
                print(f"  {fmt or 'default format'}, {n} layers: loaded in {time.perf_counter() - t0:.1f} s, "
                      f"graphs {'on' if engine.runner.cuda_graph else 'off'} (+{time.perf_counter() - START:.0f} s)",
                      flush=True)
                moe = len(engine.runner.model.moe_layers)
                rows, stopped = measure_engine(engine, variants, args, bandwidth, method)
                results += [dict(row, format=fmt, layers=n, moe_layers=moe) for row in rows]
                del engine
                RETIRED.clear()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    print(f"# {args.synthetic}, batch 1, {args.gen_len} tokens per sample, median of {args.repeats} interleaved "
          f"rounds; floor at {bandwidth / 1e9:.1f} GB/s")
    print("| format | layers | variant | decode tok/s | ms/token | vs first row | floor ms | decode/floor | "
          "own CPU us/layer | own gap us | deferred CPU us/layer | samples ms | tokens = first row |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        base = next(x for x in results if x["format"] == r["format"] and x["layers"] == r["layers"])
        print(f"| {r['format'] or 'default'} | {r['layers']} | {r['variant'].label()} | {r['decode_tok_s']:.1f} | "
              f"{r['decode_s'] * 1e3:.3f} | {base['decode_s'] / r['decode_s']:.3f}x | {r['floor_s'] * 1e3:.3f} | "
              f"{r['decode_over_floor'] or float('nan'):.2f} | {_median_of(r, 'own', 'cpu_us')} | "
              f"{_median_of(r, 'own', 'gap_us')} | {_median_of(r, 'deferred', 'cpu_us')} | "
              f"{', '.join(f'{s * 1e3:.3f}' for s in r['samples_s'])} | {r['tokens_equal_to_first_row']} |")
    fits = []
    if not stopped and len(set(depths)) >= 2 and all(r["moe_layers"] == r["layers"] for r in results):
        full_layers = full["num_hidden_layers"]
        print(f"# fitted over depths {','.join(map(str, depths))}: ms/token = fixed + per layer x layers, "
              f"at {full_layers} layers")
        print("| format | variant | fixed ms | per layer ms | decode tok/s | decode/floor | floor/layer ms |")
        print("|---|---|---|---|---|---|---|")
        for fmt in formats:
            for v in variants:
                rs = [r for r in results if r["format"] == fmt and r["variant"] == v]
                fit = fit_line([(r["layers"], r["decode_s"]) for r in rs])
                deepest = max(rs, key=lambda r: r["layers"])
                floor_layer = deepest["floor_s"] / deepest["layers"]
                t = fit.at(full_layers)
                fits.append({"format": fmt, "variant": v.label(), "fixed_s": fit.fixed, "per_layer_s": fit.per_layer,
                             "layers": full_layers, "decode_tok_s": 1 / t, "decode_over_floor": t / (floor_layer * full_layers)})
                print(f"| {fmt or 'default'} | {v.label()} | {fit.fixed * 1e3:.3f} | {fit.per_layer * 1e3:.4f} | {1 / t:.1f} | "
                      f"{t / (floor_layer * full_layers):.2f} | {floor_layer * 1e3:.4f} |")
    rows = [dict(r, variant=r["variant"].label()) for r in results]
    write_json(args.json, {"synthetic": args.synthetic, "bandwidth": bandwidth, "engine": kwargs, "rows": rows,
                           "fits": fits})
    return 0
