"""The native CPU/GPU handoff on a CUDA GPU; run by scripts/device_check.sh on the GPU host.

For both paths (stream memory operations + our polling thread; CUDA host functions; the first also
with zero-copy staging through the device's mapping of the pinned buffers), eager
enqueue must give what CpuExperts.forward gives on the same rows (same engine, same kernels: bit
for bit), and a decode-like chain of layers captured in a CUDA graph must replay to what the same
chain gives eagerly, for T = 1 and T = 4.

T tokens, K experts per token, E experts, H hidden, I expert intermediate size, L layers.
"""

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cuda_handoff import CudaHandoff
from hybridmoe.experts.tuning import EngineTuning

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E, H, I, K, TMAX, L = 16, 256, 128, 4, 4, 3


@pytest.fixture(scope="module")
def layers() -> list[CpuExperts]:
    out = []
    for layer in range(L):
        g = torch.Generator().manual_seed(layer)
        out.append(CpuExperts(torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
                              torch.randn(E, H, I, generator=g) / I**0.5, format="bf16", threads=4))
    return out


@pytest.fixture(scope="module")
def routers() -> torch.Tensor:
    """[L, H, E] router weights on the GPU."""
    return torch.randn(L, H, E, generator=torch.Generator().manual_seed(99)).cuda()


@pytest.fixture(params=["stream_mem_ops", "host_function", "stream_mem_ops+zero_copy"])
def handoff(layers, request) -> CudaHandoff:
    path, _, zero_copy = request.param.partition("+")
    handoff = CudaHandoff(layers, max_tokens=TMAX, top_k=K, path=path)
    assert handoff.path == path
    handoff.zero_copy = bool(zero_copy)  # rows staged and the output read through the mapped buffers
    return handoff


def test_auto_takes_stream_memory_operations_on_this_gpu(layers):
    assert CudaHandoff(layers, max_tokens=TMAX, top_k=K).path == "stream_mem_ops"


def test_tune_sets_every_layer_and_leaves_the_output_alone(layers, routers):
    handoff = CudaHandoff(layers, max_tokens=TMAX, top_k=K, path="stream_mem_ops")
    assert handoff.tuning == EngineTuning()
    stream = torch.cuda.current_stream()
    x = hidden(4, seed=5)
    ids, weights = route(x, routers[0])
    before = handoff.enqueue(stream, 0, x, ids, weights).clone()
    handoff.tune(EngineTuning(item_blocks=1, gate_up_tail=False, early_start=False))
    assert handoff.tuning == EngineTuning(item_blocks=1, gate_up_tail=False, early_start=False)
    after = handoff.enqueue(stream, 0, x, ids, weights)
    torch.cuda.synchronize()
    handoff.check()
    assert torch.equal(after, before)


def route(x: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K ids [T, K] and softmax weights [T, K] of x [T, H]. An elementwise product and a
    sum, not a GEMM: the same kernels in the graph and eagerly, so the ids agree exactly."""
    logits = (x.float().unsqueeze(-1) * router).sum(dim=1)
    weights, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    return ids, weights


def hidden(T: int, seed: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).cuda()


@pytest.mark.parametrize("split", [False, True], ids=["enqueue", "submit_wait"])
@pytest.mark.parametrize("T", [1, 4])
def test_eager_enqueue_equals_cpu_experts_forward(handoff, layers, routers, T, split):
    stream = torch.cuda.current_stream()
    for layer in range(L):
        x = hidden(T, seed=10 * layer + T)
        ids, weights = route(x, routers[layer])
        if split:
            handoff.enqueue_submit(stream, layer, x, ids, weights)
            out = handoff.enqueue_wait(stream, layer)
        else:
            out = handoff.enqueue(stream, layer, x, ids, weights)
        torch.cuda.synchronize()
        handoff.check()
        expected = layers[layer].forward(x.cpu(), ids.cpu(), weights.cpu())
        assert out.device.type == "cuda" and torch.equal(out.cpu(), expected)


def decode_step(handoff: CudaHandoff, routers: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """L layers of: route on the GPU, experts on the CPU through the handoff, residual add.
    Odd layers use submit/wait with GPU work between (what overlaps the CPU in the engine)."""
    for layer in range(L):
        ids, weights = route(x, routers[layer])
        if layer % 2:
            handoff.enqueue_submit(None, layer, x, ids, weights)
            shared = x * 0.5
            x = x + shared + handoff.enqueue_wait(None, layer)
        else:
            x = x + handoff.enqueue(None, layer, x, ids, weights)
    return x


@pytest.mark.parametrize("T", [1, 4])
def test_graph_replay_equals_eager(handoff, routers, T):
    static_x = hidden(T, seed=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as capture wants
        decode_step(handoff, routers, static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = decode_step(handoff, routers, static_x)
    outs = []
    for seed in (1, 2, 3):
        x = hidden(T, seed)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        replayed = static_out.clone()
        eager = decode_step(handoff, routers, x)
        torch.cuda.synchronize()
        handoff.check()
        assert torch.equal(replayed, eager)
        outs.append(replayed)
    assert not torch.equal(outs[0], outs[1])  # each replay computed its own input
    handoff.take_stats()
    for _ in range(20):  # replays queued back to back: the flag protocol holds across them
        graph.replay()
    torch.cuda.synchronize()
    handoff.check()
    assert torch.equal(static_out, outs[-1])
    if handoff.path == "stream_mem_ops":  # the polling thread ran each layer of each replay once
        stats = handoff.take_stats()
        assert stats["layers"] == 20 * L and stats["cpu_us"] > 0


def test_two_handoffs_interleaved_in_one_graph(layers, routers):
    """Two stream_mem_ops handoffs (as the engine has for deferred experts), their layers pending
    at the same time: one poller serves both."""
    a = CudaHandoff(layers[:2], max_tokens=TMAX, top_k=K, path="stream_mem_ops")
    b = CudaHandoff({0: layers[2]}, max_tokens=TMAX, top_k=K, path="stream_mem_ops")
    static_x = hidden(2, seed=0)

    def step(x):
        ids, weights = route(x, routers[0])
        a.enqueue_submit(None, 0, x, ids, weights)
        b.enqueue_submit(None, 0, x, ids, weights)
        a.enqueue_submit(None, 1, x, ids, weights)
        return a.enqueue_wait(None, 1) + b.enqueue_wait(None, 0) * 2 + a.enqueue_wait(None, 0) * 3

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_x)
    for seed in (1, 2):
        static_x.copy_(hidden(2, seed))
        graph.replay()
        torch.cuda.synchronize()
        a.check()
        b.check()
        x = static_x.cpu()
        ids, weights = (t.cpu() for t in route(static_x, routers[0]))
        expected = (layers[1].forward(x, ids, weights).cuda() + layers[2].forward(x, ids, weights).cuda() * 2
                    + layers[0].forward(x, ids, weights).cuda() * 3)
        assert torch.equal(static_out, expected)


def test_out_of_range_id_zeroes_output_and_check_raises(handoff):
    x = hidden(2, seed=0)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, E]], device="cuda")
    out = handoff.enqueue(None, 0, x, ids, torch.full((2, K), 0.25, device="cuda"))
    torch.cuda.synchronize()
    assert not out.any()
    with pytest.raises(HybridMoEError, match=r"topk_ids\[1, 3\] = 16 is out of range for 16 experts"):
        handoff.check()


@pytest.mark.parametrize("args, match", [
    (lambda: (0, hidden(1, 0).cpu()), "hidden must be a tensor on cuda:0"),
    (lambda: (0, hidden(TMAX + 1, 0)), r"1 <= T <= max_tokens \(4\)"),
    (lambda: (0, hidden(1, 0).float()), "hidden must be torch.bfloat16"),
    (lambda: (L, hidden(1, 0)), f"layer {L} has no CPU experts"),
])
def test_enqueue_argument_errors(handoff, args, match):
    layer, x = args()
    T = x.shape[0] if x.dim() == 2 else 1
    ids = torch.arange(K, device="cuda").repeat(T, 1)
    with pytest.raises(HybridMoEError, match=match):
        handoff.enqueue(None, layer, x, ids, torch.ones(T, K, device="cuda"))


def test_unknown_path_is_an_error(layers):
    with pytest.raises(HybridMoEError, match="path must be one of auto, stream_mem_ops, host_function"):
        CudaHandoff(layers, max_tokens=TMAX, top_k=K, path="polling")


def test_wait_without_submit_is_an_error(handoff):
    with pytest.raises(HybridMoEError, match="no enqueue_submit to wait for"):
        handoff.enqueue_wait(None, 0)


def test_replays_of_layers_given_out_of_order_book_each_step_and_its_gaps(layers, routers):
    """A replayed step gives what the eager step gives, and the poller books every replay as one step of L
    layers with L - 1 gaps between them."""
    # given out of order (as a model may load its layers): the handoff still numbers them in layer order
    handoff = CudaHandoff({layer: layers[layer] for layer in reversed(range(L))}, max_tokens=TMAX, top_k=K,
                          path="stream_mem_ops")
    x = hidden(1, seed=5)
    expected = decode_step(handoff, routers, x)
    torch.cuda.synchronize()
    step = graph_of(lambda: decode_step(handoff, routers, x))
    handoff.take_stats()
    for _ in range(20):
        step.replay()
    torch.cuda.synchronize()
    handoff.check()
    assert torch.equal(step.out, expected)
    stats = handoff.take_stats()
    assert (stats["steps"], stats["gaps"]) == (20, 20 * (L - 1))
    assert 0 < stats["between_us"] and 0 < stats["cpu_us"]


class graph_of:
    """fn captured in a CUDA graph after a warm-up on a side stream: replay(), out."""

    def __init__(self, fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn()

    def replay(self):
        self.graph.replay()
