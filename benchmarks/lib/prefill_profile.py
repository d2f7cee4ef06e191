"""Where one prefill step's time goes, per layer, with prefill streaming on and off, same engine.

    python3 benchmarks/prefill.py profile --synthetic qwen3-30b-a3b --layers 4 --formats int4,bf16 \\
        --prompt-lens 512,2048 --device cuda --gpu-memory-budget 16GiB
    python3 benchmarks/prefill.py profile --synthetic qwen3_moe:tiny --prompt-lens 16,32 --device cpu \\
        --dtype bfloat16 --expert-format bf16 --gpu-experts-per-layer 1          # CPU smoke run

One load per format (prefill_streaming "on"; --modes: "on" with every CPU expert streamed, "off" with the
streamer detached; GPU experts per layer as the full-depth model gets under the budget, as
`benchmarks/e2e.py` does), one prompt per length, warmed up once, then the fastest of --reps prefills
(one request, max_tokens 1) is shown. Each part is timed where it runs, without adding a host sync:
CUDA events on the compute stream for the decoder layer, its attention and its MoE block (router,
both expert shares, the join), the GPU-resident experts' share (in a streamed step the streamer
runs it, inside "stream math") and the streamed share (its wait for the copy, then "stream math":
grouping, dequantizing and the expert matmuls; the streamed share also joins the CPU's); CUDA
events on the copy stream for each layer's copy (GB/s from its bytes; layer 0's is the one started
by the previous prefill's last layer); the host clock from the CPU engine's submit to its wait's
return ("CPU experts").
"rest" is the layer minus attention and MoE block (norms, residuals); "non-layer" is the request's
wall time minus its layers (embedding, lm_head, sampling, scheduling). On the CPU device every time
is the host clock. Then one more prefill of each under torch.profiler prints its costliest ops.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import hybridmoe.experts.hybrid_parts as hybrid_parts
import hybridmoe.experts.streamed_prefill as streamed_mod
from hybridmoe.bench.synthetic import full_config, synthetic_checkpoint
from hybridmoe.commands.engine_args import add_engine_arguments, engine_kwargs
from hybridmoe.errors import HybridMoEError
from hybridmoe.llm import LLM
from hybridmoe.sampling_params import SamplingParams

from .cli import int_list, str_list, write_json
from .e2e import full_depth_gpu_experts

PARTS = ("layer", "attention", "MoE block", "CPU experts", "GPU-expert share", "streamed share", "stream math")


class Spans:
    """Named intervals keyed (layer, part): CUDA events on a stream, or host clock readings."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.done: dict[tuple[int, str], list] = defaultdict(list)
        self.open: dict[tuple[int, str], object] = {}
        self.copied_bytes: dict[int, int] = defaultdict(int)

    def begin(self, key, stream=None, host=False) -> None:
        self.open[key] = self._mark(stream, host)

    def end(self, key, stream=None, host=False) -> None:
        self.done[key].append((self.open.pop(key), self._mark(stream, host)))

    def _mark(self, stream, host: bool):
        if host or not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def totals_ms(self) -> dict[tuple[int, str], float]:
        if self.cuda:
            torch.cuda.synchronize()
        return {key: sum((b - a) * 1e3 if isinstance(a, float) else a.elapsed_time(b) for a, b in spans)
                for key, spans in self.done.items()}


class Probe:
    """Hooks on one engine's layers, CPU engines and streamer that fill `spans` while installed."""

    def __init__(self, llm: LLM):
        runner = llm.engine.runner
        self.model, self.backend = runner.model, runner.model.experts
        self.cuda = torch.device(llm.engine.config.device).type == "cuda"
        self.spans = Spans(self.cuda)
        self.layer = -1  # the decoder layer running now (parts without a layer argument belong to it)
        self.streamer = next((st.streamer for st in self.backend._layers.values() if st.streamer is not None), None)
        for i, layer in enumerate(self.model.model.layers):
            self._hook(layer, i, "layer", set_layer=True)
            self._hook(layer.self_attn, i, "attention")
            self._hook(getattr(layer, layer.mlp_name), i, "MoE block")
        for i in self.backend.layers():
            engine = self.backend.cpu_engine(i)
            if engine is not None and hasattr(engine, "submit"):
                self._wrap_cpu_engine(engine, i)
        # the functions where their callers look them up: the hybrid step's parts, the streamer
        self._restore = [(hybrid_parts, "gpu_share", hybrid_parts.gpu_share),
                         (streamed_mod, "routed_experts", streamed_mod.routed_experts)]
        hybrid_parts.gpu_share = self._timed(hybrid_parts.gpu_share, "GPU-expert share")
        streamed_mod.routed_experts = self._timed(streamed_mod.routed_experts, "stream math")
        if self.streamer is not None:
            self.streamer.run = self._timed(self.streamer.run, "streamed share")
            self._wrap_stage(self.streamer)

    def reset(self) -> None:
        self.spans = Spans(self.cuda)

    def close(self) -> None:
        """Put back the module functions wrapped for timing (the engine's own hooks go with it)."""
        for module, name, fn in self._restore:
            setattr(module, name, fn)

    def _hook(self, module, layer: int, part: str, set_layer: bool = False) -> None:
        def pre(mod, args):
            if set_layer:
                self.layer = layer
            self.spans.begin((layer, part))

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(lambda mod, args, out: self.spans.end((layer, part)))

    def _timed(self, fn, part: str):
        def timed(*args, **kwargs):
            self.spans.begin((self.layer, part))
            out = fn(*args, **kwargs)
            self.spans.end((self.layer, part))
            return out

        return timed

    def _wrap_cpu_engine(self, engine, layer: int) -> None:
        submit, wait = engine.submit, engine.wait

        def timed_submit(*args):
            self.spans.begin((layer, "CPU experts"), host=True)
            submit(*args)

        def timed_wait():
            out = wait()
            self.spans.end((layer, "CPU experts"), host=True)
            return out

        engine.submit, engine.wait = timed_submit, timed_wait

    def _wrap_stage(self, streamer) -> None:
        stage = streamer._stage

        def timed_stage(key) -> int:  # a layer, or (layer, part) of a layer streamed in parts
            if key in streamer.slot_layer:
                return stage(key)
            layer = key if isinstance(key, int) else key[0]
            self.spans.copied_bytes[layer] += streamer.units[key].nbytes
            stream = streamer.copy_stream
            if stream is not None:  # the copy starts once the slot is free: time it from there
                stream.wait_event(streamer.freed[1 if streamer.slot_layer[0] == streamer.current else 0])
            self.spans.begin((layer, "copy"), stream=stream)
            slot = stage(key)
            self.spans.end((layer, "copy"), stream=stream)
            return slot

        streamer._stage = timed_stage


def prefill_seconds(llm: LLM, prompt: list[int], probe: Probe, cold: bool) -> float:
    """Wall time of one request of max_tokens 1 (its prefill); the streamer's slots as the previous
    prefill left them (its first layer staged after its last, as in serving), or emptied if cold."""
    if cold and probe.streamer is not None:
        probe.streamer.slot_layer = [None, None]  # every layer copied, the first with nothing to hide it
    if probe.cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    if probe.cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def profile_once(llm: LLM, prompt: list[int], probe: Probe, reps: int, cold: bool) -> tuple[float, dict, dict]:
    """(wall s, part ms, copied bytes) of the fastest of reps prefills after a warm-up."""
    prefill_seconds(llm, prompt, probe, cold)
    best = None
    for _ in range(reps):
        probe.reset()
        wall = prefill_seconds(llm, prompt, probe, cold)
        if best is None or wall < best[0]:
            best = (wall, probe.spans.totals_ms(), dict(probe.spans.copied_bytes))
    return best


def table(title: str, wall: float, ms: dict, copied: dict, layers: list[int], tokens: int, depth: int) -> list[str]:
    """The per-layer table; its title line adds the prefill rate at `depth` layers, each at the mean
    time of these (the first one's unhidden copy included) after the same non-layer part."""
    layer_total = sum(ms.get((i, "layer"), 0.0) for i in layers)
    non_layer = 1e3 * wall - layer_total
    at_depth = tokens / ((non_layer + depth * layer_total / len(layers)) / 1e3)
    lines = [f"## {title}: {1e3 * wall:.2f} ms ({tokens / wall:.0f} tok/s); layers {layer_total:.2f} ms, "
             f"non-layer {non_layer:.2f} ms; at {depth} layers ~{at_depth:.0f} tok/s",
             "| layer | " + " | ".join(PARTS) + " | rest | copy | copy GB/s |",
             "|---" * (len(PARTS) + 4) + "|"]
    rows = []
    for i in layers:
        row = [ms.get((i, p), 0.0) for p in PARTS]
        row.append(row[0] - row[1] - row[2])
        copy = ms.get((i, "copy"), 0.0)
        row += [copy, copied.get(i, 0) / copy / 1e6 if copy else 0.0]
        rows.append(row)
        lines.append(f"| {i} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
    mean = [sum(col) / len(rows) for col in zip(*rows)]
    lines.append("| mean | " + " | ".join(f"{v:.2f}" for v in mean) + " |")
    return lines


def top_ops(llm: LLM, prompt: list[int], probe: Probe, rows: int, cold: bool) -> str:
    """torch.profiler's costliest ops (self time on the device, or on the CPU) over one prefill."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if probe.cuda else [])
    with profile(activities=activities) as prof:
        prefill_seconds(llm, prompt, probe, cold)
    key = "self_device_time_total" if probe.cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)


def give_full_depth_gpu_experts(args, kwargs: dict) -> None:
    """Give a cut model the GPU experts per layer its full depth gets under the budget (as e2e does)."""
    raw_full = full_config(args.synthetic)
    if args.layers is None or args.layers >= raw_full["num_hidden_layers"] or "gpu_experts_per_layer" in kwargs \
            or kwargs.get("gpu_memory_budget") is None:
        return
    per_layer, note = full_depth_gpu_experts(raw_full, {k: v for k, v in kwargs.items() if k != "cache_dir"})
    kwargs["gpu_experts_per_layer"] = per_layer
    print(note, flush=True)


def run_format(model_dir: str, fmt: str | None, kwargs: dict, lens: list[int], args) -> list[dict]:
    """Each prompt length and mode of one format profiled and printed; their part times for the JSON."""
    run_kwargs = dict(kwargs, **({"expert_format": fmt} if fmt else {}))
    t0 = time.perf_counter()
    llm = LLM(model_dir, **run_kwargs)
    ec = llm.engine.resolved_config
    probe = Probe(llm)
    print(f"# {fmt or ec.expert_format}: loaded in {time.perf_counter() - t0:.1f} s; {ec.gpu_experts_per_layer} GPU "
          f"experts per layer, {ec.cpu_threads or 'all'} CPU threads, streamer "
          f"{'attached' if probe.streamer else 'none'}", flush=True)
    if probe.streamer is None:
        raise HybridMoEError("no prefill streamer was attached (streaming needs the native engine and a GPU "
                             "split: --gpu-memory-budget or --gpu-experts-per-layer)")
    if probe.cuda:  # the costs "auto" decides from (the loader measures them only when it decides)
        fp = probe.backend.plan.footprint
        costs = probe.streamer.measured or streamed_mod.measured_costs(probe.streamer, fp.top_k, fp.num_experts)[0]
        print(f"# measured at load, a layer: CPU {1e3 * costs.cpu_fixed:.2f} ms + {1e3 * costs.cpu_per_token:.4f} ms a "
              f"token; copy {1e3 * costs.copy:.2f} ms; device work {1e3 * costs.gpu_fixed:.2f} ms + "
              f"{1e3 * costs.gpu_per_token:.4f} ms a token; auto streams from {costs.threshold()} tokens", flush=True)
        for n in lens:  # the load-time decision at each length, to set beside the measured layers below
            print(f"#   {n} tokens: CPU path {1e3 * costs.cpu(n):.2f} ms, streamed max(copy, work "
                  f"{1e3 * costs.work(n):.2f}) = {1e3 * costs.stream(n):.2f} ms a layer", flush=True)
    layers = list(range(len(probe.model.model.layers)))
    gen = torch.Generator().manual_seed(args.seed)
    results = []
    try:
        for n in lens:
            prompt = torch.randint(0, llm.engine.vocab_size, (n,), generator=gen).tolist()
            for mode in str_list(args.modes):
                probe.backend.stream_long_steps(probe.streamer if mode != "off" else None)
                wall, ms, copied = profile_once(llm, prompt, probe, args.reps, args.cold)
                print("\n".join(table(f"{fmt or ec.expert_format}, {n} tokens, streaming {mode}", wall, ms,
                                      copied, layers, n, args.depth)), flush=True)
                per_layer = [{"layer": i, **{part: ms.get((i, part), 0.0) for part in (*PARTS, "copy")},
                              "copied_bytes": copied.get(i, 0)} for i in layers]
                results.append({"format": fmt or ec.expert_format, "tokens": n, "streaming": mode, "wall_s": wall,
                                "layers_ms": per_layer})
                if args.top_ops:
                    probe.reset()
                    print(top_ops(llm, prompt, probe, args.top_ops, args.cold), flush=True)
    finally:
        probe.close()
        probe.streamer.close()
    return results


def add_arguments(parser):
    parser.add_argument("--synthetic", metavar="PRESET", required=True, help="a make-model preset, written to memory")
    parser.add_argument("--layers", type=int, help="decoder layers (default: full depth)")
    parser.add_argument("--formats", help="expert formats to run in turn, e.g. int4,bf16 (default: the engine's)")
    parser.add_argument("--prompt-lens", default="512,2048", help="prompt lengths (default 512,2048)")
    parser.add_argument("--reps", type=int, default=2, help="timed prefills per case, the fastest shown (default 2)")
    parser.add_argument("--top-ops", type=int, default=12, help="torch.profiler rows per case (0: no profiler run)")
    parser.add_argument("--modes", default="on,off",
                        help="on: every CPU expert streamed, off: no streaming (default on,off)")
    parser.add_argument("--cold", action="store_true",
                        help="empty the streamer's two slots before each prefill (every layer copied)")
    parser.add_argument("--seed", type=int, default=0)
    add_engine_arguments(parser)


def run(args) -> int:
    lens = int_list(args.prompt_lens)
    kwargs = engine_kwargs(args)
    kwargs.update(cache_dir="", max_num_seqs=1, prefill_streaming="on",
                  prefill_streaming_tokens=min(lens), max_model_len=max(lens) + 8)
    kwargs.setdefault("max_num_batched_tokens", max(lens + [2048]))
    give_full_depth_gpu_experts(args, kwargs)
    args.depth = full_config(args.synthetic)["num_hidden_layers"]
    results = []
    with synthetic_checkpoint(args.synthetic, args.layers, seed=args.seed) as synthetic:
        for fmt in str_list(args.formats) or [None]:
            results += run_format(str(synthetic.out_dir), fmt, kwargs, lens, args)
    write_json(args.json, {"synthetic": args.synthetic, "layers": args.layers, "engine": kwargs, "results": results})
    return 0
