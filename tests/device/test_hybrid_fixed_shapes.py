"""MoE layers of HybridExperts on CUDA in fixed shapes (CPU share through the native handoff, GPU
share by fixed_shape_experts) equal the synchronous path, eagerly and as a CUDA graph replay, for
splits with no, some, most (fewer CPU experts than K) and all experts on the GPU, with 0, 1 and 2
deferred experts, routed by the caller (forward) or by the backend's fused router (forward_logits),
one layer alone and two in a row (the first one's deferred experts still on the CPU while the
second one's own run). Runs on the GPU host through scripts/device_check.sh.

T tokens, E experts, K experts per token, H hidden, I intermediate.
"""

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.gpu_experts import weighted_experts
from hybridmoe.experts.hybrid import HybridExperts
from hybridmoe.experts.placement import Footprint, PlacementPlan
from hybridmoe.layers.router import softmax_topk

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E, H, I, K, TMAX = 8, 64, 32, 3, 8
FP32 = dict(atol=1e-4, rtol=1e-4)


def backend(gpu_ids: list[int], deferred: int, layers: int = 1) -> HybridExperts:
    fp = Footprint(0, 0, 0, 3 * I * H * 4, list(range(layers)), E, K, H, I)
    plan = PlacementPlan(fp, None, "test", {layer: gpu_ids for layer in range(layers)} if gpu_ids else {})
    b = HybridExperts(plan, "cuda", lambda g, u, d: CpuExperts(g, u, d, format="bf16", threads=2),
                      deferred_experts=deferred, num_layers=layers)
    g = torch.Generator().manual_seed(0)
    for layer in range(layers):
        b.set_layer(layer, *weights(g))
    return b


def weights(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's gate, up [E, I, H] and down [E, H, I]."""
    return torch.randn(E, I, H, generator=g) / 8, torch.randn(E, I, H, generator=g) / 8, torch.randn(E, H, I, generator=g) / 6


WEIGHTS = weights(torch.Generator().manual_seed(0))  # layer 0's


def layer(b: HybridExperts, x, ids, w) -> torch.Tensor:
    """The layer's output as the model sees it: its own experts, then the deferred ones joined."""
    return b.after_layer(0, b.forward(0, x, ids, w))


def routed(b: HybridExperts, layer_idx: int, x, logits) -> torch.Tensor:
    """The MoE block's output from router logits [T, E], as SparseMoeBlock gets it."""
    out = b.forward_logits(layer_idx, x, logits, K, True)
    if out is None:  # the synchronous path: the caller routes
        w, ids = softmax_topk(logits, K, True, fused=False)
        out = b.forward(layer_idx, x, ids, w)
    return out


def chain(b: HybridExperts, x, router: torch.Tensor) -> torch.Tensor:
    """Two decoder layers' residual stream, each layer only its MoE block routed by router [H, E]."""
    h = x
    for i in range(2):
        h = b.after_layer(i, h + routed(b, i, h, h @ router))
    return h


def replayed(fixed: HybridExperts, fn):
    """fn() captured in a CUDA graph and replayed once (after an eager warm-up)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    fixed.check()
    return out


@pytest.mark.parametrize("deferred", [0, 1, 2])
@pytest.mark.parametrize("gpu_ids", [[], [0, 3, 5], [0, 1, 2, 3, 4, 5], list(range(E))])
@pytest.mark.parametrize("T", [1, 6])
def test_fixed_shapes_equal_the_synchronous_path_eager_and_replayed(T, gpu_ids, deferred):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).cuda()
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K, dim=-1)
    ids, w = ids.cuda(), w.cuda()
    want = layer(backend(gpu_ids, deferred), x, ids, w)
    # one layer: its deferred experts join right after it, so the layer is every routed expert's sum (the CPU
    # engine's bf16 weights and activations: a loose bound, far below a misweighted expert)
    torch.testing.assert_close(want.cpu(), weighted_experts(x.cpu(), *WEIGHTS, ids.cpu(), w.cpu(), None, F.silu),
                               atol=3e-2, rtol=0)
    fixed = backend(gpu_ids, deferred)
    assert fixed.use_fixed_shapes(TMAX, torch.float32)
    torch.testing.assert_close(layer(fixed, x, ids, w), want, **FP32)
    torch.testing.assert_close(replayed(fixed, lambda: layer(fixed, x, ids, w)), want, **FP32)


@pytest.mark.parametrize("deferred", [0, 1, 2])
@pytest.mark.parametrize("gpu_ids", [[], [0, 3, 5], list(range(E))])
@pytest.mark.parametrize("T", [1, 4])
def test_two_layers_routed_by_the_fused_router_equal_the_synchronous_path(T, gpu_ids, deferred):
    g = torch.Generator().manual_seed(10 + T)
    x = torch.randn(T, H, generator=g).cuda()
    router = torch.randn(H, E, generator=g).cuda()
    want = chain(backend(gpu_ids, deferred, layers=2), x, router)
    fixed = backend(gpu_ids, deferred, layers=2)
    assert fixed.use_fixed_shapes(TMAX, torch.float32)
    torch.testing.assert_close(chain(fixed, x, router), want, **FP32)
    torch.testing.assert_close(replayed(fixed, lambda: chain(fixed, x, router)), want, **FP32)
    if deferred:  # deferral is not a no-op here: the reference is not vacuous
        assert not torch.allclose(want, chain(backend(gpu_ids, 0, layers=2), x, router), **FP32)


def test_deferred_experts_switched_in_fixed_shapes_equal_a_backend_made_with_them():
    g = torch.Generator().manual_seed(20)
    x = torch.randn(2, H, generator=g).cuda()
    router = torch.randn(H, E, generator=g).cuda()
    want = chain(backend([0, 3, 5], 2, layers=2), x, router)
    switched = backend([0, 3, 5], 0, layers=2)
    assert switched.use_fixed_shapes(TMAX, torch.float32)
    exact = chain(switched, x, router)
    torch.testing.assert_close(replayed(switched, lambda: chain(switched, x, router)), exact, **FP32)
    switched.set_deferred_experts(2)  # new handoffs: the graph above is not replayed again
    torch.testing.assert_close(chain(switched, x, router), want, **FP32)
    torch.testing.assert_close(replayed(switched, lambda: chain(switched, x, router)), want, **FP32)
    switched.set_deferred_experts(0)
    torch.testing.assert_close(chain(switched, x, router), exact, **FP32)
