"""The GPU's share of the routed-expert bytes, ours and llama.cpp's, and the -ncmoe that matches ours.

Our engine places experts one by one (uniform: n of E in every MoE layer); llama.cpp moves whole layers:
`-ncmoe K` keeps the routed experts of blocks 0..K-1 on the CPU, the rest go with -ngl to the GPU. K is
chosen so that llama.cpp's GPU share of the MoE layers is the nearest to ours (all on the CPU: K = every
block; a tie keeps the layer on the CPU). A cut model has few MoE layers, so llama.cpp's share moves in steps of
1 / MoE layers: both shares are reported.
"""

from __future__ import annotations

import math
import re

from gguf import GGUFReader

from hybridmoe.errors import HybridMoEError

from .e2e import full_depth_gpu_experts

_EXPS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


def ncmoe_for_share(num_layers: int, moe_layers: list[int], gpu_share: float) -> int:
    """-ncmoe K for llama-bench: the fewest leading blocks whose routed experts stay on the CPU such that the
    MoE layers at or after K hold the share of MoE layers nearest to gpu_share (0..1)."""
    if not 0.0 <= gpu_share <= 1.0:
        raise HybridMoEError(f"a GPU share is between 0 and 1, got {gpu_share}")
    moe = sorted(moe_layers)
    on_cpu = len(moe) - math.floor(gpu_share * len(moe) + 0.5 - 1e-9)  # MoE layers left on the CPU
    if on_cpu >= len(moe):
        return num_layers
    return moe[on_cpu - 1] + 1 if on_cpu > 0 else 0


def llama_gpu_share(expert_bytes: dict[int, int], ncmoe: int) -> float:
    """The share of routed-expert bytes on the GPU under -ncmoe (expert_bytes: block -> its expert tensors' bytes)."""
    total = sum(expert_bytes.values())
    return sum(b for layer, b in expert_bytes.items() if layer >= ncmoe) / total if total else 0.0


def gguf_expert_bytes(path: str) -> dict[int, int]:
    """Block -> bytes of its stacked routed-expert tensors in a GGUF file."""
    out: dict[int, int] = {}
    for t in GGUFReader(path, "r").tensors:
        m = _EXPS.fullmatch(t.name)
        if m is not None:
            out[int(m.group(1))] = out.get(int(m.group(1)), 0) + int(t.n_bytes)
    return out


def our_gpu_experts(share: str, raw_full: dict, kwargs: dict, model_dir: str) -> tuple[int, str]:
    """GPU experts per MoE layer for share ("cpu": none; else a GPU memory budget such as "16GiB", applied to the
    full-depth model as benchmarks/e2e.py does for a cut one) and a line saying how it was chosen."""
    if share == "cpu":
        return 0, "every routed expert on the CPU"
    return full_depth_gpu_experts(raw_full, dict(kwargs, gpu_memory_budget=share), model_dir)
