"""Every bad argument to CpuExperts (and to the native engine under it) raises one line that names the
argument (issue #25): meta and sparse tensors, non-tensors, wrong dtypes and shapes, integers past
int32/int64, negative counts. Never nanobind's list of signatures ("incompatible function arguments").

T tokens, K experts per token, E experts, H hidden, I expert intermediate size.
"""

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import _native

E, H, I, T, K = 4, 64, 32, 3, 2
HUGE = 2**70  # past int64
BIG = 2**40  # past int32, within int64


@pytest.fixture(scope="module")
def experts():
    g = torch.Generator().manual_seed(0)
    return CpuExperts(torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g),
                      torch.randn(E, H, I, generator=g), threads=2)


def weights():
    return torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)


def routing():
    return {"x": torch.randn(T, H), "topk_ids": torch.tensor([[0, 1], [2, 3], [1, 2]]), "topk_weights": torch.rand(T, K)}


def assert_one_line_naming(err: pytest.ExceptionInfo, name: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert "incompatible function arguments" not in msg
    assert name in msg, msg


META, SPARSE = (lambda t: t.to("meta")), (lambda t: t.to_sparse())

CALL_CASES = [  # (argument, change, what the message names)
    ("x", META, "x is a meta tensor"),
    ("x", SPARSE, "x must be a dense tensor"),
    ("x", lambda t: t.tolist(), "x must be a torch.Tensor"),
    ("x", lambda t: t.double(), "x must be bfloat16 or float32"),
    ("x", lambda t: t[:, :H // 2], "x has shape"),
    ("x", lambda t: t.t().contiguous().t(), "x must be contiguous"),
    ("topk_ids", META, "topk_ids is a meta tensor"),
    ("topk_ids", SPARSE, "topk_ids must be a dense tensor"),
    ("topk_ids", lambda t: t.float(), "topk_ids must be int32 or int64"),
    ("topk_ids", lambda t: t[:, :1].repeat(1, 3), "topk_weights has shape"),
    ("topk_ids", lambda t: t + E, "topk_ids[0, 0] = 4 is out of range"),
    ("topk_ids", lambda t: t - 1, "topk_ids[0, 0] = -1 is out of range"),
    ("topk_ids", lambda t: t + BIG, "topk_ids[0, 0] = 1099511627776 is out of range"),
    ("topk_ids", lambda t: t.fill_(2**63 - 1), "topk_ids[0, 0] = 9223372036854775807 is out of range"),
    ("topk_ids", lambda t: t.int() + 2**31 - 1 - E, "is out of range"),
    ("topk_weights", META, "topk_weights is a meta tensor"),
    ("topk_weights", SPARSE, "topk_weights must be a dense tensor"),
    ("topk_weights", lambda t: t.double(), "topk_weights must be float32"),
    ("topk_weights", lambda t: t[:2], "topk_weights has shape"),
    ("out", lambda _: torch.empty(T, H, device="meta"), "out is a meta tensor"),
    ("out", lambda _: torch.empty(T, H).to_sparse(), "out must be a dense tensor"),
    ("out", lambda _: torch.empty(T, H, dtype=torch.bfloat16), "out must be float32"),
    ("out", lambda _: torch.empty(T, H + 1), "out has shape"),
]


@pytest.mark.parametrize("method", ["forward", "submit"])
@pytest.mark.parametrize("arg,change,names", CALL_CASES, ids=[f"{a}-{n}" for a, _, n in CALL_CASES])
def test_a_bad_call_argument_is_named(experts, method, arg, change, names):
    args = routing()
    args["out"] = torch.empty(T, H)
    args[arg] = change(args[arg])
    with pytest.raises(HybridMoEError) as err:
        getattr(experts, method)(**args)
    assert_one_line_naming(err, names)
    assert torch.isfinite(experts.forward(**routing())).all()  # nothing pending, the engine still works


@pytest.mark.parametrize("deferred,names", [(HUGE, "deferred must be between 0 and"), (-1, "deferred must be"),
                                            (K + 1, "deferred must be between 0 and the 2 slots"),
                                            ("1", "deferred must be an integer")])
@pytest.mark.parametrize("method", ["forward_deferred", "submit_deferred"])
def test_a_bad_deferred_count_is_named(experts, method, deferred, names):
    with pytest.raises(HybridMoEError) as err:
        getattr(experts, method)(**routing(), deferred=deferred)
    assert_one_line_naming(err, names)


def test_a_meta_input_to_a_deferred_call_is_named(experts):
    args = routing()
    with pytest.raises(HybridMoEError) as err:
        experts.forward_deferred(args["x"].to("meta"), args["topk_ids"], args["topk_weights"], 1)
    assert_one_line_naming(err, "x is a meta tensor")


CONSTRUCTION_CASES = [  # (keyword arguments, what the message names)
    ({"threads": 0}, "threads must be between 1 and 1024, got 0"),
    ({"threads": -3}, "threads must be between 1 and 1024, got -3"),
    ({"threads": 1500}, "threads must be between 1 and 1024, got 1500"),
    ({"threads": BIG}, "threads must be between 1 and 1024"),
    ({"threads": HUGE}, "threads must be between 1 and 1024"),
    ({"threads": 2.5}, "threads must be an integer, got float"),
    ({"threads": "4"}, "threads must be an integer, got str"),
    ({"numa_nodes": 0}, "numa_nodes must be between 1 and"),
    ({"numa_nodes": HUGE}, "numa_nodes must be between 1 and"),
    ({"group_size": HUGE}, "group_size must be between 1 and 2147483647"),
    ({"group_size": -64}, "group_size must be between 1 and"),
    ({"format": "int4", "group_size": BIG}, "group_size must be between 1 and 2147483647"),
    ({"format": 4}, "unknown expert format"),
    ({"isa": 3}, "isa must be a string"),
]


@pytest.mark.parametrize("kwargs,names", CONSTRUCTION_CASES, ids=[n for _, n in CONSTRUCTION_CASES])
def test_a_bad_construction_argument_is_named(kwargs, names):
    with pytest.raises(HybridMoEError) as err:
        CpuExperts(*weights(), **kwargs)
    assert_one_line_naming(err, names)


@pytest.mark.parametrize("which,change,names", [
    (0, META, "gate_proj is a meta tensor"),
    (1, SPARSE, "up_proj must be a dense tensor"),
    (2, lambda t: t.tolist(), "down_proj must be a torch.Tensor"),
    (2, lambda t: t[:, :, :-1], "down_proj must be [E, H, I]"),
    (0, lambda t: t.int(), "gate_proj must be a float tensor"),
])
def test_bad_weights_are_named(which, change, names):
    w = list(weights())
    w[which] = change(w[which])
    with pytest.raises(HybridMoEError) as err:
        CpuExperts(*w, threads=2)
    assert_one_line_naming(err, names)


def test_a_bad_expert_from_a_stream_is_named():
    gate, up, down = weights()
    stream = [(gate[e], up[e], down[e].to("meta") if e == 1 else down[e]) for e in range(E)]
    with pytest.raises(HybridMoEError) as err:
        CpuExperts.from_experts(stream, E, threads=2)
    assert_one_line_naming(err, "expert 1's down is a meta tensor")


def test_a_meta_codes_tensor_is_named():
    def codes(N, K):
        return torch.zeros(E, N, K, dtype=torch.uint8), torch.ones(E, N, K // 32), torch.zeros(E, N, K // 32)
    up = (codes(I, H)[0].to("meta"), *codes(I, H)[1:])
    with pytest.raises(HybridMoEError) as err:
        CpuExperts.from_codes(codes(I, H), up, codes(H, I), threads=2)
    assert_one_line_naming(err, "up_proj codes is a meta tensor")


@pytest.mark.parametrize("call,names", [
    (lambda ex: ex.dequantized(HUGE), "expert index must be between 0 and 3"),
    (lambda ex: ex.dequantized(-1), "expert index must be between 0 and 3, got -1"),
    (lambda ex: ex.trace(HUGE), "trace takes a number of calls between 0 and"),
    (lambda ex: ex.trace(-1), "trace takes a number of calls between 0 and 2147483647, got -1"),
    (lambda ex: ex.trace(1.5), "calls must be an integer"),
    (lambda ex: ex.prefetch([0, BIG]), "experts[1] = 1099511627776 is out of range for 4 experts"),
    (lambda ex: ex.prefetch([HUGE]), "experts must be a list or tensor of expert indexes"),
    (lambda ex: ex.prefetch(torch.tensor([-1])), "experts[0] = -1 is out of range for 4 experts"),
    (lambda ex: ex.prefetch([0.5]), "experts must hold integer expert indexes"),
    (lambda ex: ex.prefetch(torch.zeros(2, dtype=torch.int32, device="meta")), "experts is a meta tensor"),
    (lambda ex: ex.prefetch(torch.tensor([1, 0]).to_sparse()), "experts must be a dense tensor"),
])
def test_bad_arguments_to_the_other_methods_are_named(experts, call, names):
    with pytest.raises(HybridMoEError) as err:
        call(experts)
    assert_one_line_naming(err, names)


# The native entry points themselves: integers within int64 but past their range, named by the bindings.
@pytest.mark.parametrize("call,names", [
    (lambda n: n.MoeEngine(BIG, H, I, "bf16", 128, False, 2, "", 1, False), "E (experts) must be between 1 and"),
    (lambda n: n.MoeEngine(E, BIG, I, "bf16", 128, False, 2, "", 1, False), "H (hidden size) must be between"),
    (lambda n: n.MoeEngine(E, H, BIG, "bf16", 128, False, 2, "", 1, False), "I (intermediate size) must be"),
    (lambda n: n.MoeEngine(E, H, I, "bf16", BIG, False, 2, "", 1, False), "group_size must be between 1 and"),
    (lambda n: n.MoeEngine(E, H, I, "bf16", 128, False, BIG, "", 1, False), "threads must be between 1 and 1024"),
    (lambda n: n.MoeEngine(E, H, I, "bf16", 128, False, 2, "", BIG, False), "numa_nodes must be between 1 and"),
    (lambda n: n._pool_help_check(BIG, 1, 1, False), "threads must be between 1 and 1024"),
    (lambda n: n.read_bandwidth(1 << 20, BIG), "threads must be at most 1024"),
    (lambda n: n.CudaHandoff(BIG, 2), "max_tokens must be between 1 and"),
    (lambda n: n.CudaHandoff(4, -BIG), "top_k must be between 1 and"),
])
def test_the_native_bindings_name_an_out_of_range_integer(call, names):
    with pytest.raises(ValueError) as err:
        call(_native())
    assert_one_line_naming(err, names)


@pytest.mark.parametrize("call,names", [
    (lambda eng: eng.trace(BIG), "calls must be between 0 and"),
    (lambda eng: eng.unpack_expert(BIG, torch.empty(I, H), torch.empty(I, H), torch.empty(H, I)),
     "expert index 1099511627776 out of range"),
])
def test_the_native_engine_names_an_out_of_range_integer(experts, call, names):
    with pytest.raises(ValueError) as err:
        call(experts._engine)
    assert_one_line_naming(err, names)
