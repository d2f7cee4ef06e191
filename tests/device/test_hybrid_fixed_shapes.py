"""One MoE layer of HybridExperts on CUDA in fixed shapes (CPU share through the native handoff,
GPU share by fixed_shape_experts) equals the synchronous path, eagerly and as a CUDA graph replay,
for splits with no, some, most (fewer CPU experts than K) and all experts on the GPU, with and
without a deferred expert. Runs on the GPU host through scripts/device_check.sh.

T tokens, E experts, K experts per token, H hidden, I intermediate.
"""

import pytest
import torch

from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.hybrid import HybridExperts
from hybridmoe.experts.placement import Footprint, PlacementPlan

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E, H, I, K, TMAX = 8, 64, 32, 3, 8
FP32 = dict(atol=1e-4, rtol=1e-4)


def backend(gpu_ids: list[int], deferred: int) -> HybridExperts:
    fp = Footprint(0, 0, 0, 3 * I * H * 4, [0], E, K, H, I)
    plan = PlacementPlan(fp, None, "test", {0: gpu_ids} if gpu_ids else {})
    b = HybridExperts(plan, "cuda", lambda g, u, d: CpuExperts(g, u, d, format="bf16", threads=2),
                      deferred_experts=deferred, num_layers=1)
    g = torch.Generator().manual_seed(0)
    b.set_layer(0, torch.randn(E, I, H, generator=g) / 8, torch.randn(E, I, H, generator=g) / 8,
                torch.randn(E, H, I, generator=g) / 6)
    return b


def layer(b: HybridExperts, x, ids, w) -> torch.Tensor:
    """The layer's output as the model sees it: its own experts, then the deferred ones joined."""
    return b.after_layer(0, b.forward(0, x, ids, w))


@pytest.mark.parametrize("deferred", [0, 1])
@pytest.mark.parametrize("gpu_ids", [[], [0, 3, 5], [0, 1, 2, 3, 4, 5], list(range(E))])
@pytest.mark.parametrize("T", [1, 6])
def test_fixed_shapes_equal_the_synchronous_path_eager_and_replayed(T, gpu_ids, deferred):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).cuda()
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K, dim=-1)
    ids, w = ids.cuda(), w.cuda()
    want = layer(backend(gpu_ids, deferred), x, ids, w)
    fixed = backend(gpu_ids, deferred)
    assert fixed.use_fixed_shapes(TMAX, torch.float32)
    torch.testing.assert_close(layer(fixed, x, ids, w), want, **FP32)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = layer(fixed, x, ids, w)
    graph.replay()
    torch.cuda.synchronize()
    fixed.check()
    torch.testing.assert_close(replayed, want, **FP32)
