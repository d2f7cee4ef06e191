"""Long prefill steps with each layer's experts streamed to the GPU vs computed on the CPU, same process.

    python3 benchmarks/prefill.py streamed --shape qwen3-30b-a3b --format int4 --layers 4 --tokens 2048
    python3 benchmarks/prefill.py streamed ... --model DIR [--prompt-len 2048]   # also end to end

Layer part (needs a GPU): --layers MoE layers of random packed experts at the shape (each its own copy
of one layer's bytes, so every copy comes from DRAM), one routing of --tokens tokens; per layer, the
median ms of: the native CPU engine; streaming with the next layer's copy overlapped (prefetch) and
without; the host-to-device copy of one layer's packed bytes from memory registered with
cudaHostRegister, through a pinned bounce buffer (CPU memcpy + DMA), and from pageable memory (GB/s).

End-to-end part (--model, a checkpoint from `hybridmoe make-model`): prefill tok/s of one --prompt-len
prompt, every routed expert on the CPU (gpu_experts_per_layer 0), with streaming on and off in the
same engine (one load, the streamer detached for "off"). Streamed prefills start with both slots
empty, so every layer is copied as in a model deeper than the two slots (a 2-layer model would
otherwise keep both layers on the GPU between prompts). Prints a table; --json writes the numbers.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import CpuExperts, default_threads
from hybridmoe.experts.packed_torch import PackedLayout
from hybridmoe.experts.streamed_prefill import PrefillStreamer
from hybridmoe.llm import LLM
from hybridmoe.sampling_params import SamplingParams

from .cli import write_json
from .common import SHAPES

PAGE = 4096


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def page_aligned(n: int) -> torch.Tensor:
    """n bytes that share no memory page with another buffer (cudaHostRegister pins whole pages)."""
    t = torch.empty(n + 2 * PAGE, dtype=torch.uint8)
    off = -t.data_ptr() % PAGE
    return t[off:off + n]


def random_packed_state(fmt: str, E: int, H: int, I: int, group: int) -> dict:
    """A layer's packed buffers filled with random codes and small scales (packing real weights at this
    size takes minutes; the kernels' speed does not depend on the values)."""
    layout = PackedLayout({"shape": [E, H, I], "format": fmt, "group_size": group, "zero_points": False,
                           "numa_nodes": 1})
    buffers = {}
    for name, n in layout.buffer_bytes().items():
        buf = page_aligned(n)
        if name.endswith(".scale"):
            buf.view(torch.float32).fill_(0.01)
        elif fmt == "bf16":
            buf.view(torch.bfloat16).copy_(torch.randn(n // 2) * 0.02)
        else:
            buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
        buffers[name] = buf.numpy()
    return {"shape": [E, H, I], "format": fmt, "group_size": group, "zero_points": False, "numa_nodes": 1,
            "buffers": buffers}


def copied_state(state: dict) -> dict:
    """The same packed layer in new memory (another layer's weights, as far as caches can tell)."""
    buffers = {}
    for name, arr in state["buffers"].items():
        buf = page_aligned(arr.nbytes)
        buf.copy_(torch.from_numpy(arr).view(torch.uint8))
        buffers[name] = buf.numpy()
    return {**state, "buffers": buffers}


def copy_rates(host: dict[str, torch.Tensor], registered: bool, reps: int) -> dict[str, float]:
    """GB/s of one layer's packed bytes host -> GPU: registered memory, a pinned bounce buffer, pageable."""
    nbytes = sum(b.numel() for b in host.values())
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    bounce = torch.empty(nbytes, dtype=torch.uint8).pin_memory()

    def direct(non_blocking: bool):
        off = 0
        for b in host.values():
            dst[off:off + b.numel()].copy_(b, non_blocking=non_blocking)
            off += b.numel()

    def via_bounce():
        off = 0
        for b in host.values():
            bounce[off:off + b.numel()].copy_(b)
            off += b.numel()
        dst.copy_(bounce, non_blocking=True)

    rates = {"bounce": nbytes / median_ms(via_bounce, reps) / 1e6}
    if registered:
        rates["registered"] = nbytes / median_ms(lambda: direct(True), reps) / 1e6
    else:
        rates["pageable"] = nbytes / median_ms(lambda: direct(False), reps) / 1e6
    return rates


def layer_part(args) -> dict:
    s = SHAPES[args.shape]
    E, H, I, K, T = s["E"], s["H"], s["I"], s["K"], args.tokens
    first = random_packed_state(args.format, E, H, I, args.group_size)
    engines = {layer: CpuExperts.from_packed(first if layer == 0 else copied_state(first), threads=args.threads)
               for layer in range(args.layers)}
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, K]
    w = torch.rand(T, K, generator=g)
    x = (torch.randn(T, H, generator=g) * 0.1).to(torch.bfloat16)
    host0 = {n: torch.from_numpy(a).view(torch.uint8) for n, a in engines[0].packed_state()["buffers"].items()}
    pageable = copy_rates(host0, False, args.reps)  # before the streamer registers these pages

    def cpu_layers():
        for e in engines.values():
            e.forward(x, ids, w)

    cpu_ms = median_ms(cpu_layers, args.reps) / args.layers
    print(f"(CPU engine {cpu_ms:.2f} ms a layer; pageable copy {pageable['pageable']:.1f} GB/s)")
    streamer = PrefillStreamer(engines, "cuda", min_tokens=1)
    xd, idsd, wd, mask = x.cuda(), ids.cuda(), w.cuda(), torch.ones(T, K, dtype=torch.bool, device="cuda")

    def streamed_layers():
        streamer.slot_layer = [None, None]  # every layer copied again, as in a new step
        for layer in engines:
            streamer.run(layer, xd, idsd, wd, mask, F.silu)

    results = {}
    for prefetch in (True, False):
        streamer.prefetch_next = prefetch
        streamed_layers()  # warm-up (and the host registration)
        results[prefetch] = median_ms(streamed_layers, args.reps) / args.layers
        print(f"(streamed, prefetch {prefetch}: {results[prefetch]:.2f} ms a layer)")
    copies = copy_rates(streamer.layers[0].buffers, bool(streamer.layers[0].registered), args.reps)
    streamer.close()
    layer_bytes = streamer.layers[0].nbytes
    return {"shape": args.shape, "format": args.format, "tokens": T, "layers": args.layers,
            "layer_mb": layer_bytes / 1e6, "cpu_ms_per_layer": cpu_ms, "streamed_ms_per_layer": results[True],
            "streamed_no_prefetch_ms_per_layer": results[False], "copy_gbps": {**copies, **pageable},
            "registered": bool(streamer.layers[0].registered)}


def e2e_part(args) -> dict:
    llm = LLM(args.model, device="cuda", expert_format=args.format, expert_group_size=args.group_size,
              gpu_experts_per_layer=0, gpu_memory_budget=args.budget, prefill_streaming="on",
              prefill_streaming_tokens=min(512, args.prompt_len), max_num_batched_tokens=args.prompt_len,
              max_model_len=args.prompt_len + 8, cuda_graph=False)
    backend = llm.engine.runner.model.experts
    streamer = next(st.streamer for st in backend._layers.values() if st.streamer is not None)
    prompt = torch.randint(10, 1000, (args.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def prefill_s() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([prompt], one)
        return time.perf_counter() - t0

    def streamed_s() -> float:
        streamer.slot_layer = [None, None]  # every layer copied again, as in a model deeper than two layers
        return prefill_s()

    out = {}
    for mode in ("on", "off", "on", "off"):  # interleaved: drift hits both
        backend.stream_long_steps(streamer if mode == "on" else None)
        timed = streamed_s if mode == "on" else prefill_s
        timed()
        out.setdefault(mode, []).append(min(timed() for _ in range(args.reps)))
        print(f"(prefill streaming {mode}: {args.prompt_len / out[mode][-1]:.0f} tok/s)")
    return {"model": args.model, "prompt_len": args.prompt_len,
            "prefill_tok_s_streamed": args.prompt_len / min(out["on"]),
            "prefill_tok_s_cpu": args.prompt_len / min(out["off"])}


def add_arguments(ap):
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=SHAPES)
    ap.add_argument("--format", default="int4", choices=["bf16", "int8", "int4"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", help="a checkpoint directory for the end-to-end part")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--budget", default="16GiB", help="gpu_memory_budget of the end-to-end part")
    ap.add_argument("--skip-layers", action="store_true", help="only the end-to-end part")


def run(args) -> int:
    if not torch.cuda.is_available():
        raise HybridMoEError("streamed prefill needs a CUDA GPU to measure")
    report = {"threads": args.threads or default_threads(), "gpu": torch.cuda.get_device_name()}
    if not args.skip_layers:
        r = report["layers"] = layer_part(args)
        print(f"{r['shape']} {r['format']}, T={r['tokens']}, {r['layers']} layers of {r['layer_mb']:.0f} MB packed, "
              f"{report['threads']} CPU threads, {report['gpu']}")
        print("| per layer | ms | tok/s of the layer's experts |\n|---|---|---|")
        for label, key in (("CPU engine", "cpu_ms_per_layer"), ("streamed, next layer prefetched",
                           "streamed_ms_per_layer"), ("streamed, no prefetch", "streamed_no_prefetch_ms_per_layer")):
            print(f"| {label} | {r[key]:.2f} | {1e3 * r['tokens'] / r[key]:.0f} |")
        print(f"speedup streamed / CPU: {r['cpu_ms_per_layer'] / r['streamed_ms_per_layer']:.2f}x; copy GB/s: "
              + ", ".join(f"{k} {v:.1f}" for k, v in r["copy_gbps"].items()))
    if args.model:
        r = report["e2e"] = e2e_part(args)
        print(f"end to end, {r['prompt_len']}-token prompt, every routed expert on the CPU: prefill "
              f"{r['prefill_tok_s_streamed']:.0f} tok/s streamed vs {r['prefill_tok_s_cpu']:.0f} tok/s on the CPU "
              f"({r['prefill_tok_s_streamed'] / r['prefill_tok_s_cpu']:.2f}x)")
    write_json(args.json, report)
    return 0
