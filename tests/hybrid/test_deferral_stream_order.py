"""The fixed-shape (CUDA graph) path of HybridExperts with deferred experts, run on the CPU through a stand-in
for the CUDA handoff that computes each CPU part when it is waited for and records the order of the stream's
operations: the result equals the synchronous path, and the order is the one that overlaps the CPU with the
GPU (a layer's own CPU part, then its deferred part, both sent before anything waits; the previous layer's
deferred part waited for before this layer's own, which the CPU finishes after it; no wait between layers
for a deferred part).

T tokens, E experts, K experts per token, H hidden, I expert intermediate size.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.experts.gpu_experts import weighted_experts
from hybridmoe.experts.hybrid import HybridExperts, TorchCpuLayer
from hybridmoe.experts.placement import Footprint, PlacementPlan
from hybridmoe.layers.router import softmax_topk

E, H, I, K, LAYERS = 8, 32, 16, 3, 3
GPU = [0, 3, 5]


class StreamLog:
    """The stream's CPU operations in the order enqueued: (part, "go" | "wait", layer)."""

    def __init__(self):
        self.ops: list[tuple[str, str, int]] = []


class CpuHandoff:
    """CudaHandoff's enqueue_submit / enqueue_wait on CPU tensors: the rows are staged at submit, the layer's
    CPU experts computed at wait (the native engine's result; repeated padding slots of weight 0 included).
    zero_copy: staging(layer, T) hands out the layer's staging buffers, which a staged submit reads."""

    path = "host_function"  # no flag words: no kernel plays them

    def __init__(self, part: str, layers: dict[int, TorchCpuLayer], log: StreamLog, width: int, zero_copy: bool):
        self.part, self.layers, self.log, self.zero_copy = part, layers, log, zero_copy
        self.dtype = torch.float32
        self.staged: dict[int, tuple] = {}
        self.buffers = {layer: (torch.full((8, H), float("nan")), torch.zeros(8, width, dtype=torch.int64),
                                torch.full((8, width), float("nan"))) for layer in layers}

    def staging(self, layer, T):
        x, ids, w = self.buffers[layer]
        return SimpleNamespace(x=x[:T], ids=ids[:T], weights=w[:T])

    def enqueue_submit(self, stream, layer, hidden, topk_ids, topk_weights, staged=False, signaled=False):
        assert layer not in self.staged and not signaled and (self.zero_copy or not staged)
        rows = self.staging(layer, hidden.shape[0])
        self.staged[layer] = ((rows.x, rows.ids, rows.weights) if staged else
                              (hidden.clone(), topk_ids.clone(), topk_weights.clone()))
        self.log.ops.append((self.part, "go", layer))

    def enqueue_wait(self, stream, layer, out=None, in_kernel=False):
        assert not in_kernel
        x, ids, w = self.staged.pop(layer)
        self.log.ops.append((self.part, "wait", layer))
        c = self.layers[layer]
        return weighted_experts(x, c.gate, c.up, c.down, ids, w, None, F.silu)


def backend(deferred: int, log: StreamLog | None = None, staged: bool = False) -> HybridExperts:
    fp = Footprint(0, 0, 0, 3 * I * H * 4, list(range(LAYERS)), E, K, H, I)
    plan = PlacementPlan(fp, None, "test", {layer: GPU for layer in range(LAYERS)})
    b = HybridExperts(plan, "cpu", TorchCpuLayer, deferred_experts=deferred, num_layers=LAYERS)
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        b.set_layer(layer, torch.randn(E, I, H, generator=g) / 4, torch.randn(E, I, H, generator=g) / 4,
                    torch.randn(E, H, I, generator=g) / 3)
    if log is not None:  # the fixed-shape path, its handoffs on the CPU
        cpu = {layer: b.cpu_engine(layer) for layer in range(LAYERS)}
        width = min(K - deferred, E - len(GPU)), min(deferred, E - len(GPU))
        own = CpuHandoff("own", cpu, log, width[0], staged)  # zero_copy: what kernel_flags stages through
        later = CpuHandoff("deferred", cpu, log, width[1], staged)
        b._handoffs = {(part is later, layer): (part, w) for part, w in ((own, width[0]), (later, width[1]))
                       for layer in range(LAYERS)}
        b._fixed_tokens = 8
        b._handoff = lambda deferred_part, layer, hidden: b._handoffs.get((deferred_part, layer), (None, 0))
    return b


def chain(b: HybridExperts, x: torch.Tensor, routers: torch.Tensor, fused_router: bool,
          residual: bool = False) -> torch.Tensor:
    """LAYERS decoder layers' residual stream, each only its MoE block, routed by routers[i] [H, E]; residual:
    the fused router's backend adds the residual stream to the block's output itself."""
    h = x
    for i in range(LAYERS):
        logits = h @ routers[i]
        if fused_router and residual:
            h = b.after_layer(i, b.forward_logits(i, h, logits, K, True, residual=h))
            continue
        out = b.forward_logits(i, h, logits, K, True) if fused_router else None
        if out is None:  # the caller routes (the synchronous path; DeepSeek's own router)
            w, ids = softmax_topk(logits, K, True, fused=False)
            out = b.forward(i, h, ids, w)
        h = b.after_layer(i, h + out)
    return h


@pytest.mark.parametrize("T,deferred,fused_router,staged,residual",
                         [(1, 1, True, False, False), (4, 2, True, False, False), (4, 1, False, False, False),
                          (1, 2, False, False, False), (1, 1, True, True, False), (4, 2, True, True, False),
                          (4, 1, False, True, False), (1, 1, True, False, True), (4, 2, True, True, True)])
def test_fixed_shapes_with_deferral_equal_the_synchronous_path_in_overlapping_order(T, deferred, fused_router,
                                                                                   staged, residual):
    """staged: the handoffs have staging buffers (zero_copy), and the fused router writes the own part's rows
    into them (HybridTuning.kernel_flags; the deferred part and the caller-routed path still hand theirs over
    at submit; the stand-in has no flag words to signal). residual: the backend adds
    the residual stream to the MoE output (in the kernel that sums the parts, where it can)."""
    g = torch.Generator().manual_seed(T)
    x, routers = torch.randn(T, H, generator=g), torch.randn(LAYERS, H, E, generator=g)
    want = chain(backend(deferred), x, routers, fused_router)
    log = StreamLog()
    torch.testing.assert_close(chain(backend(deferred, log, staged), x, routers, fused_router, residual),
                               want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(want, chain(backend(0), x, routers, fused_router), atol=1e-3)  # deferral is not a no-op
    expected = [("own", "go", 0), ("deferred", "go", 0), ("own", "wait", 0)]
    for layer in range(1, LAYERS):
        expected += [("own", "go", layer), ("deferred", "go", layer), ("deferred", "wait", layer - 1),
                     ("own", "wait", layer)]
    assert log.ops == expected + [("deferred", "wait", LAYERS - 1)]
