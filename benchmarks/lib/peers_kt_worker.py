"""kt-kernel's side of `peers.py kt`, in a process of its own: its worker threads never share the cores with
ours, and a crash of its extension (SIGILL on a CPU without its ISA) ends this process, not the benchmark.

    python3 -m benchmarks.lib.peers_kt_worker SPEC_JSON     (run from the repository root by peers_kt.py)

SPEC: kt_dir (.peers/kt_kernel), format (bf16, int8, int4), E, H, I, K, tokens, threads, reps, budget_s,
outputs (a file for the layer's outputs, read back to compare with ours). One stdout line is RESULT_MARK +
JSON (the extension's own prints may come after it): {"variant", "class", "ms": {T: median ms}, "load_s"} or
{"error": "..."}.

kt-kernel is driven as its own benchmarks drive it (kt-kernel/bench/bench_moe_amx.py, bench_bf16_moe.py): a
CPUInfer over one worker pool of `threads` threads, MOEConfig(E, K, H, I, mask) with bf16 [E, I, H] / [E, H, I]
weights by address (int8 and int4: quantized by kt-kernel itself as it loads them, "online"), the layer's
forward_task submitted and synced per call. Its TaskQueue's thread and the caller's sync() spin without pause,
each on a CPU of its own, so the worker pool gets `threads` - 2 threads (at least 1): the layer's calls then use
the same CPUs as ours. max_len is rounded up to a multiple of MAX_LEN_STEP (its int8 and int4 buffers need
whole AMX row blocks). The extension is loaded by kt-kernel's own chooser
(kt_kernel/_cpu_detect.py, cpuid) without importing its package, whose other modules need packages this
benchmark does not (safetensors loaders, gguf readers).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
import traceback
from pathlib import Path

import torch

from .moe_layer import make_weights, routing
from .peers_kt_calls import timed_ms

RESULT_MARK = "PEERS_KT_RESULT "
CLASSES = {"bf16": "AMXBF16_MOE", "int8": "AMXInt8_MOE", "int4": "AMXInt4_MOE"}
"""Our format -> kt-kernel's MoE class (int8/int4 quantized from bf16 as they load, per output channel)."""
SUPPORTED_VARIANTS = ("amx", "avx512_bf16")
SPINNING_THREADS = 2
"""kt-kernel's threads besides its pool that spin while a call runs: the TaskQueue's worker and sync()'s caller."""
MAX_LEN_STEP = 256


class KtUnavailable(Exception):
    """kt-kernel cannot run here; the message says why."""


def load_extension(kt_dir: Path):
    """(kt_kernel_ext, its variant) as kt-kernel's own loader picks it on this CPU."""
    package = kt_dir / "kt_kernel"
    detect_py = package / "_cpu_detect.py"
    if not detect_py.is_file():
        raise KtUnavailable(f"no kt-kernel in {kt_dir}: run `python3 benchmarks/peers.py sources` where the wheel "
                            "is and carry .peers/")
    built = sorted({m.group(1) for p in package.glob("_kt_kernel_ext_*.so")
                    if (m := re.search(r"\.(cpython-\d+)", p.name))})
    here = f"cpython-{sys.version_info.major}{sys.version_info.minor}"
    if here not in built:
        raise KtUnavailable(f"kt-kernel's extensions are built for {', '.join(built) or 'nothing'}; this is "
                            f"Python {sys.version_info.major}.{sys.version_info.minor} ({here})")
    spec = importlib.util.spec_from_file_location("kt_kernel_cpu_detect", detect_py)
    detect = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(detect)
    wanted = detect.detect_cpu_features()
    if wanted not in SUPPORTED_VARIANTS:
        raise KtUnavailable(f"kt-kernel's choice for this CPU is its {wanted} extension; .peers/ holds "
                            f"{' and '.join(SUPPORTED_VARIANTS)} only")
    ext, variant = detect.initialize()
    return ext, variant


class KtLayer:
    """One kt-kernel MoE layer and its pool; the tensors it reads by address are kept alive here."""

    def __init__(self, ext, fmt: str, gate, up, down, K: int, max_len: int, threads: int):
        E, I, H = gate.shape
        config = ext.WorkerPoolConfig()
        config.subpool_count = 1
        config.subpool_numa_map = [0]
        config.subpool_thread_count = [max(1, threads - SPINNING_THREADS)]
        self.cpu_infer = ext.CPUInfer(config)
        self.weights = [gate.contiguous(), up.contiguous(), down.contiguous()]
        self.gpu_mask = torch.zeros(E, dtype=torch.bool)  # every expert on the CPU
        self.expert_map = torch.arange(E, dtype=torch.int64)
        moe_config = ext.moe.MOEConfig(E, K, H, I, self.gpu_mask.data_ptr())
        moe_config.layer_idx = 0
        moe_config.pool = self.cpu_infer.backend_
        moe_config.max_len = -(-max_len // MAX_LEN_STEP) * MAX_LEN_STEP
        moe_config.gate_proj, moe_config.up_proj, moe_config.down_proj = (w.data_ptr() for w in self.weights)
        cls = getattr(ext.moe, CLASSES[fmt], None)
        if cls is None:
            raise KtUnavailable(f"this kt-kernel extension has no {CLASSES[fmt]}")
        self.name = CLASSES[fmt]
        self.moe = cls(moe_config)
        self.cpu_infer.submit(self.moe.load_weights_task(self.expert_map.data_ptr()))
        self.cpu_infer.sync()
        self.K = K

    def forward(self, x, ids, w, out, qlen) -> None:
        """x bf16 [T, H], ids int64 [T, K], w float32 [T, K] -> out bf16 [T, H]; qlen int32 [1] holds T."""
        self.cpu_infer.submit(self.moe.forward_task(qlen.data_ptr(), self.K, ids.data_ptr(), w.data_ptr(),
                                                    x.data_ptr(), out.data_ptr(), False))
        self.cpu_infer.sync()


def measure(spec: dict) -> dict:
    """The kt-kernel layer of spec's format timed at each T as ours is (benchmarks/lib/moe_layer.py's helpers)."""
    ext, variant = load_extension(Path(spec["kt_dir"]))
    E, H, I, K = spec["E"], spec["H"], spec["I"], spec["K"]
    gate, up, down = make_weights(E, H, I)
    t0 = time.perf_counter()
    layer = KtLayer(ext, spec["format"], gate, up, down, K, max(spec["tokens"]), spec["threads"])
    load_s = time.perf_counter() - t0
    torch.set_num_threads(1)  # torch's own workers stay off the cores kt-kernel's pool uses
    ms, outputs = {}, {}
    for T in spec["tokens"]:
        out, qlen = torch.empty(T, H, dtype=torch.bfloat16), torch.tensor([T], dtype=torch.int32)

        def call(x, ids, w):
            layer.forward(x.contiguous(), ids.long().contiguous(), w.float().contiguous(), out, qlen)
            return out

        outputs[T] = call(*routing(T, H, E, K, seed=T)).clone()
        ms[T], _ = timed_ms(call, T, H, E, K, spec["reps"], spec["budget_s"])
    torch.save(outputs, spec["outputs"])
    return {"variant": variant, "class": layer.name, "ms": ms, "load_s": load_s}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    try:
        result = measure(spec)
    except KtUnavailable as e:
        result = {"error": str(e)}
    except Exception as e:  # noqa: BLE001 (the parent reports it as kt-kernel's failure, with the traceback above)
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
    print("\n" + RESULT_MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
