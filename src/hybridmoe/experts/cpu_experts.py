"""Routed experts of one MoE layer on the CPU, through the native engine (hybridmoe._native).

Shapes: T tokens, K experts per token, E experts, H hidden, I expert intermediate size.

    experts = CpuExperts(gate_proj, up_proj, down_proj, format="int4", group_size=64)
    out = experts.forward(x, topk_ids, topk_weights)           # x [T, H] bf16/fp32 -> [T, H]
    experts.submit(x, topk_ids, topk_weights); ...; out = experts.wait()   # GIL released
    out = torch.ops.hybridmoe.cpu_experts(x, topk_ids, topk_weights, experts.handle)  # traceable
    grad_x, grad_topk_weights = experts.backward(x, topk_ids, topk_weights, grad_out)  # frozen experts

Weights are quantized and tiled once, here, expert by expert (a float32 copy of one expert at
a time, never of the layer); block-FP8 codes (fp8_codes.py Fp8Codes) go into the fp8 format as they
are, MXFP4 codes (mxfp4_codes.py Mxfp4Codes) into the mxfp4 format. `packed_state()` /
`CpuExperts.from_packed(state)` move the packed form without repacking (the buffers are used in place, e.g.
memory-mapped from a cache file).

An expert computes down(silu(gate x) * up x) unless told otherwise: `set_glu(ClampedSwiGLU(alpha, limit))` gives
it gpt-oss's clamped SwiGLU (layers/clamped_swiglu.py) and `set_biases(gate_bias, up_bias, down_bias)` its
projections' biases; neither is part of the packed state.

Bad arguments raise HybridMoEError (a ValueError) with one line that names the argument: integers
are checked here (type and range) before they reach the engine, tensors the engine cannot read
(meta, sparse, not a tensor) are named here, and the engine checks the rest (shape, dtype,
contiguity, device, expert ids). A pool whose threads the system refuses raises it too.
"""

from __future__ import annotations

import itertools
import math
import operator
import os
import weakref
from collections.abc import Iterable

import numpy as np
import torch
from torch.utils.dlpack import to_dlpack

from hybridmoe.config import MAX_CPU_THREADS
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.fp8_codes import FP8_BLOCK, Fp8Codes, dense_weights
from hybridmoe.experts.mxfp4_codes import BLOCK as MXFP4_BLOCK
from hybridmoe.experts.mxfp4_codes import Mxfp4Codes
from hybridmoe.experts.tuning import EngineTuning, from_native, to_native
from hybridmoe.layers.clamped_swiglu import ClampedSwiGLU

FORMATS = ("bf16", "int8", "int4", "fp8", "mxfp4")
MAX_THREADS = MAX_CPU_THREADS
"""The most workers one layer's pool may have (config.MAX_CPU_THREADS, the native engine's kMaxThreads): past
every CPU of the largest hosts, where more threads than CPUs only take turns on them."""
_INT32_MAX = 2**31 - 1

# Layers reachable from the custom op by handle (the op's schema takes tensors and ints only).
_LAYERS: "weakref.WeakValueDictionary[int, CpuExperts]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


@torch.library.custom_op("hybridmoe::cpu_experts", mutates_args=())
def cpu_experts_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   handle: int) -> torch.Tensor:
    """The layer `handle` (CpuExperts.handle) on x [T, H]: what CpuExperts.forward returns."""
    layer = _LAYERS.get(handle)
    if layer is None:
        raise HybridMoEError(f"no live CpuExperts layer has handle {handle}")
    return layer.forward(x, topk_ids, topk_weights)


@cpu_experts_op.register_fake
def _(x, topk_ids, topk_weights, handle):
    return torch.empty_like(x)


def _native():
    try:
        from hybridmoe import _native
    except ImportError as e:
        raise HybridMoEError(f"the native CPU expert engine is not built ({e}); "
                             "reinstall with `pip install --no-build-isolation -e .`") from None
    return _native


def available_isas() -> list[str]:
    """Kernel paths this CPU can run, slowest first (generic, avx2, avx512, amx)."""
    return list(_native().available_isas())


def default_threads() -> int:
    """Every CPU this process may run on."""
    return len(os.sched_getaffinity(0))


def _int_arg(name: str, value, lo: int, hi: int) -> int:
    """value as an int if it is an integer (int, numpy or 0-d torch integer) in [lo, hi]; else HybridMoEError."""
    try:
        v = operator.index(value)
    except TypeError:
        raise HybridMoEError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if not lo <= v <= hi:
        raise HybridMoEError(f"{name} must be between {lo} and {hi}, got {v}")
    return v


def _threads_arg(threads) -> int:
    """threads checked: 1 to MAX_THREADS (default: every allowed CPU)."""
    if threads is None:
        return min(default_threads(), MAX_THREADS)
    n = _int_arg("threads", threads, -math.inf, math.inf)
    if not 1 <= n <= MAX_THREADS:
        raise HybridMoEError(f"threads must be between 1 and {MAX_THREADS}, got {n} "
                             f"(this process may use {default_threads()} CPUs)")
    return n


def _tensor_problem(name: str, t) -> str | None:
    """Why the engine cannot read t as the dense tensor `name` at all (None: it can try; its own checks
    then say what else is wrong)."""
    if not isinstance(t, torch.Tensor):
        return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if t.is_meta:
        return f"{name} is a meta tensor (shape only, no data); pass a CPU tensor"
    if t.layout != torch.strided:
        return f"{name} must be a dense tensor, got layout {t.layout}; call .to_dense() first"
    return None


def _check_tensor(name: str, t) -> None:
    problem = _tensor_problem(name, t)
    if problem:
        raise HybridMoEError(problem)


def _engine_error(e: Exception, **args) -> HybridMoEError:
    """The engine's error for a call with these named arguments, on one line: the first argument the engine
    cannot read at all if there is one, else the engine's own message (nanobind's list of signatures for
    arguments it cannot convert, shortened to the types it got)."""
    for name, value in args.items():
        problem = _tensor_problem(name, value)
        if problem:
            return HybridMoEError(problem)
    return HybridMoEError(_one_line(e))


def _one_line(e: Exception) -> str:
    msg = str(e)
    if "incompatible function arguments" not in msg:
        return msg
    fn = msg.split("(", 1)[0]
    got = msg.rsplit("Invoked with types: ", 1)[-1].strip().replace("\n", " ")
    return f"the native engine's {fn}() cannot take arguments of types ({got})"


class CpuExperts:
    """The routed experts of one layer, packed for the CPU kernels.

    gate_proj, up_proj [E, I, H] and down_proj [E, H, I] in any float dtype. format: "bf16",
    "int8" (per-output-channel symmetric), "int4" (group-wise, group_size 32/64/128, with
    zero points if zero_points=True), "fp8" (e4m3 with one float32 scale per 128x128 block,
    amax / 448, as DeepSeek-V3's checkpoints; from_experts takes such checkpoints' codes as they
    are) or "mxfp4" (e2m1 with one e8m0 power-of-two scale per 32 input channels of a row, OCP MX's
    2^(floor(log2(amax)) - 2); H and I multiples of 32; from_experts takes gpt-oss's codes as they are).
    threads: workers (default: every allowed CPU). isa: "generic" | "avx2" | "avx512" | "amx" (default: the
    fastest this CPU has). numa_nodes: worker groups, each owning a slice of
    every expert's output rows (default 1).
    """

    def __init__(self, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor,
                 format: str = "bf16", group_size: int = 128, threads: int | None = None,
                 isa: str | None = None, zero_points: bool = False, numa_nodes: int = 1):
        for name, t in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
            _check_tensor(name, t)
        if gate_proj.dim() != 3 or up_proj.shape != gate_proj.shape:
            raise HybridMoEError(f"gate_proj and up_proj must both be [E, I, H], got "
                                 f"{tuple(gate_proj.shape)} and {tuple(up_proj.shape)}")
        E, I, H = gate_proj.shape
        if tuple(down_proj.shape) != (E, H, I):
            raise HybridMoEError(f"down_proj must be [E, H, I] = {[E, H, I]}, got {list(down_proj.shape)}")
        for name, t in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
            if not t.dtype.is_floating_point:
                raise HybridMoEError(f"{name} must be a float tensor, got {t.dtype}")
        self._init_engine(E, H, I, format, group_size, zero_points, threads, isa, numa_nodes, adopt=False)
        self._pack_experts(((gate_proj[e], up_proj[e], down_proj[e]) for e in range(E)), E)

    def _pack_experts(self, experts: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], E: int) -> None:
        # One expert at a time in float32, through buffers reused from expert to expert: packing never holds
        # a float copy of the layer, nor maps and faults in fresh memory for each expert. The next expert is
        # asked for only once the last one is packed.
        # Block-FP8 codes go into the fp8 format as they are, MXFP4 codes into mxfp4; elsewhere (or beside float
        # matrices) through float.
        _, H, I = self._engine.shape
        staging = (torch.empty(I, H), torch.empty(I, H), torch.empty(H, I))
        iter_experts = iter(experts)
        for e in range(E):
            expert = next(iter_experts, None)
            if expert is None:
                raise HybridMoEError(f"got {e} experts, expected num_experts={E}")
            if self.format == "fp8" and all(isinstance(w, Fp8Codes) for w in expert):
                self._pack_fp8(e, expert, [buf.shape for buf in staging])
                continue
            if self.format == "mxfp4" and all(isinstance(w, Mxfp4Codes) for w in expert):
                self._pack_mxfp4(e, expert, [buf.shape for buf in staging])
                continue
            expert = dense_weights(expert)
            for name, buf, w in zip(("gate", "up", "down"), staging, expert):
                _check_tensor(f"expert {e}'s {name}", w)
                if not w.dtype.is_floating_point:
                    raise HybridMoEError(f"expert {e}'s {name} must be a float tensor, got {w.dtype}")
                if w.shape != buf.shape:
                    raise HybridMoEError(f"expert {e}'s {name} must be {list(buf.shape)}, got {list(w.shape)}")
                buf.copy_(w.detach())
            self._call(self._engine.pack_expert, e, *staging)
        if next(iter_experts, None) is not None:
            raise HybridMoEError(f"got more experts than num_experts={E}")

    def _pack_fp8(self, e: int, expert: tuple[Fp8Codes, ...], shapes: list[torch.Size]) -> None:
        arrays = []
        for name, w, shape in zip(("gate", "up", "down"), expert, shapes):
            if w.codes.dtype != torch.float8_e4m3fn or w.codes.shape != shape:
                raise HybridMoEError(f"expert {e}'s {name} codes must be float8_e4m3fn {list(shape)}, got "
                                     f"{w.codes.dtype} {list(w.codes.shape)}")
            blocks = [-(-n // FP8_BLOCK) for n in shape]
            if list(w.scale.shape) != blocks:
                raise HybridMoEError(f"expert {e}'s {name} scales must be {blocks} (one per {FP8_BLOCK}x{FP8_BLOCK} "
                                     f"block), got {list(w.scale.shape)}")
            arrays += [w.codes.contiguous().view(torch.uint8), w.scale.float().contiguous()]
        self._call(self._engine.pack_expert_fp8, e, arrays)

    def _pack_mxfp4(self, e: int, expert: tuple[Mxfp4Codes, ...], shapes: list[torch.Size]) -> None:
        arrays = []
        for name, w, (N, K) in zip(("gate", "up", "down"), expert, shapes):
            want = ([N, K // 2], [N, K // MXFP4_BLOCK])
            got = (list(w.codes.shape), list(w.scales.shape))
            if w.codes.dtype != torch.uint8 or w.scales.dtype != torch.uint8 or got != want:
                raise HybridMoEError(f"expert {e}'s {name} codes and scales must be uint8 {want[0]} and {want[1]} "
                                     f"(two e2m1 codes a byte, an e8m0 scale per {MXFP4_BLOCK}), got {w.codes.dtype} "
                                     f"{got[0]} and {w.scales.dtype} {got[1]}")
            arrays += [w.codes.contiguous(), w.scales.contiguous()]
        self._call(self._engine.pack_expert_mxfp4, e, arrays)

    def _init_engine(self, E, H, I, format, group_size, zero_points, threads, isa, numa_nodes, adopt):
        if format not in FORMATS:
            raise HybridMoEError(f"unknown expert format {format!r}; choose one of {', '.join(FORMATS)}")
        if isa is not None and not isinstance(isa, str):
            raise HybridMoEError(f"isa must be a string or None, got {type(isa).__name__}")
        E, H, I = (_int_arg(name, v, 1, _INT32_MAX) for name, v in (("E (experts)", E), ("H (hidden size)", H),
                                                                      ("I (intermediate size)", I)))
        group_size = _int_arg("group_size", group_size, 1, _INT32_MAX)
        threads = _threads_arg(threads)
        numa_nodes = _int_arg("numa_nodes", numa_nodes, 1, threads)
        try:  # RuntimeError: the system refused the pool's threads
            self._engine = _native().MoeEngine(E, H, I, format, group_size, bool(zero_points), threads, isa or "",
                                               numa_nodes, adopt)
        except (ValueError, TypeError, RuntimeError) as e:
            raise HybridMoEError(_one_line(e)) from None
        self._adopted: dict[str, object] = {}
        self._pending: tuple | None = None
        self._glu: ClampedSwiGLU | None = None
        self.handle = next(_HANDLES)  # for torch.ops.hybridmoe.cpu_experts(x, ids, w, handle)
        _LAYERS[self.handle] = self

    @staticmethod
    def _call(fn, *args):
        try:
            return fn(*args)
        except (ValueError, TypeError) as e:
            raise HybridMoEError(_one_line(e)) from None

    @classmethod
    def from_packed(cls, state: dict, threads: int | None = None, isa: str | None = None) -> "CpuExperts":
        """Experts from `packed_state()` output; its buffers are used in place, not copied."""
        self = cls.__new__(cls)
        E, H, I = state["shape"]
        self._init_engine(E, H, I, state["format"], state["group_size"], state["zero_points"], threads, isa,
                          state["numa_nodes"], adopt=True)
        expected = set(self._engine.buffers())
        given = set(state["buffers"])
        if given != expected:
            raise HybridMoEError(f"packed state does not match its shape/format: missing "
                                 f"{sorted(expected - given)}, unexpected {sorted(given - expected)}")
        for name, buf in state["buffers"].items():
            arr = buf.numpy() if isinstance(buf, torch.Tensor) else np.asarray(buf)
            self._call(self._engine.set_buffer, name, arr)
            self._adopted[name] = arr
        return self

    @classmethod
    def from_experts(cls, experts: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], num_experts: int,
                     format: str = "bf16", group_size: int = 128, threads: int | None = None, isa: str | None = None,
                     zero_points: bool = False, numa_nodes: int = 1) -> "CpuExperts":
        """Experts packed from (gate [I, H], up [I, H], down [H, I]) of one expert at a time, in expert order.

        The next expert is asked for only once the last one is packed, so a lazy source (a generator reading
        a checkpoint) holds one expert at a time and may drop each one's memory as soon as it is packed.
        Same packed bytes as the constructor on the stacked tensors. A matrix may come as Fp8Codes (block-FP8
        codes and scales) or Mxfp4Codes: format "fp8" (or "mxfp4") packs an expert whose three matrices are so
        without float, bit for bit.
        """
        iter_experts = iter(experts)
        first = next(iter_experts, None)
        if first is None:
            raise HybridMoEError(f"from_experts got no experts, expected num_experts={num_experts}")
        if len(first[0].shape) != 2:
            raise HybridMoEError(f"an expert's gate must be [I, H], got {list(first[0].shape)}")
        I, H = first[0].shape
        self = cls.__new__(cls)
        self._init_engine(num_experts, H, I, format, group_size, zero_points, threads, isa, numa_nodes, adopt=False)
        self._pack_experts(itertools.chain([first], iter_experts), num_experts)
        return self

    @classmethod
    def from_codes(cls, gate_proj: tuple, up_proj: tuple, down_proj: tuple, threads: int | None = None,
                   isa: str | None = None, numa_nodes: int = 1) -> "CpuExperts":
        """int4 experts packed from codes, never through float (GPTQ/AWQ/compressed-tensors weights).

        Each projection is (codes uint8 [E, N, K] in 0..15, scales, zeros fp32 [E, N, K/group]) for
        W = (codes - zeros) * scales per group, or with zeros None for W = (codes - 8) * scales (symmetric: a
        layer without zero points); gate/up N, K = I, H and down H, I.
        """
        projs = (gate_proj, up_proj, down_proj)
        zero_points = gate_proj[2] is not None
        if any((p[2] is not None) != zero_points for p in projs):
            raise HybridMoEError("from_codes: give zero points for every projection or for none")
        for proj, parts in zip(("gate_proj", "up_proj", "down_proj"), projs):
            for part, t in zip(("codes", "scales", "zeros"), parts[:3 if zero_points else 2]):
                _check_tensor(f"{proj} {part}", t)
        self = cls.__new__(cls)
        (E, I, H), group = gate_proj[0].shape, gate_proj[0].shape[2] // gate_proj[1].shape[2]
        self._init_engine(E, H, I, "int4", group, zero_points, threads, isa, numa_nodes, adopt=False)
        for e in range(E):
            self._call(self._engine.pack_expert_codes, e, [t[e].contiguous() for p in projs
                                                          for t in p[:3 if zero_points else 2]])
        return self

    def packed_state(self) -> dict:
        """Shape, format and packed buffers (numpy views of this object's memory)."""
        eng = self._engine
        return {"shape": list(eng.shape), "format": eng.format, "group_size": eng.group_size,
                "zero_points": eng.zero_points, "numa_nodes": eng.numa_nodes, "buffers": dict(eng.buffers())}

    @property
    def num_experts(self) -> int:
        return self._engine.shape[0]

    @property
    def format(self) -> str:
        return self._engine.format

    @property
    def isa(self) -> str:
        return self._engine.isa

    @property
    def threads(self) -> int:
        return self._engine.threads

    @property
    def packed_bytes(self) -> int:
        return sum(b.nbytes for b in self._engine.buffers().values())

    @property
    def glu(self) -> ClampedSwiGLU | None:
        """The experts' activation: None for silu(gate x) * up x, else the clamped SwiGLU (set_glu)."""
        return self._glu

    def set_glu(self, glu: ClampedSwiGLU | None) -> None:
        """h = glu(gate x + gate bias, up x + up bias) for every expert of later calls: a ClampedSwiGLU (gpt-oss's,
        its alpha and limit), or None for silu(gate) * up (the default)."""
        self._between_calls("set_glu")
        if glu is None:
            self._call(self._engine.set_glu, "silu", 0.0, 0.0)
        elif isinstance(glu, ClampedSwiGLU):
            self._call(self._engine.set_glu, "clamped_swiglu", float(glu.alpha), float(glu.limit))
        else:
            raise HybridMoEError(f"glu must be a ClampedSwiGLU or None (silu), got {type(glu).__name__}")
        self._glu = glu

    @property
    def has_biases(self) -> bool:
        return self._engine.has_biases

    def set_biases(self, gate_bias: torch.Tensor, up_bias: torch.Tensor, down_bias: torch.Tensor) -> None:
        """The experts' biases for later calls, in any float dtype (copied as float32): gate_bias, up_bias [E, I] are
        added to gate x and up x before the activation, down_bias [E, H] to each expert's output before its routing
        weight multiplies it."""
        self._between_calls("set_biases")
        biases = []
        for name, t in (("gate_bias", gate_bias), ("up_bias", up_bias), ("down_bias", down_bias)):
            _check_tensor(name, t)
            if not t.dtype.is_floating_point:
                raise HybridMoEError(f"{name} must be a float tensor, got {t.dtype}")
            biases.append(t.detach().to("cpu", torch.float32).contiguous())
        self._call(self._engine.set_biases, *biases)

    def _between_calls(self, what: str) -> None:
        if self._pending is not None:
            raise HybridMoEError(f"{what}() called between submit() and wait(); call wait() first")

    def dequantized(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's weights as the kernels see them (after quantization), float32."""
        E, H, I = self._engine.shape
        e = _int_arg("expert index", e, 0, E - 1)
        gate, up, down = torch.empty(I, H), torch.empty(I, H), torch.empty(H, I)
        self._call(self._engine.unpack_expert, e, gate, up, down)
        return gate, up, down

    def prewake(self) -> None:
        """Wake the pool's sleeping workers now, ahead of a submit()/forward() (e.g. when the
        layer's routing starts), so their wake-up overlaps it; a cheap no-op while they spin."""
        self._engine.prewake()

    def prefetch(self, experts: torch.Tensor | list[int]) -> int:
        """Read these experts' packed weights into the CPU's caches now (the pool's workers, GIL
        released; returns the bytes read), so that a call soon after may find them there instead of in
        DRAM. Results never depend on it; EngineTuning.prefetch_touch says how each line is read."""
        E = self.num_experts
        try:
            ids = torch.as_tensor(experts)
        except (TypeError, ValueError, RuntimeError):
            raise HybridMoEError(f"experts must be a list or tensor of expert indexes, got {type(experts).__name__}"
                                 ) from None
        _check_tensor("experts", ids)
        ids = ids.reshape(-1)
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise HybridMoEError(f"experts must hold integer expert indexes, got {ids.dtype}")
        bad = ((ids < 0) | (ids >= E)).nonzero()
        if len(bad):
            i = int(bad[0, 0])
            raise HybridMoEError(f"experts[{i}] = {int(ids[i])} is out of range for {E} experts")
        return self._call(self._engine.prefetch, ids.to(torch.int32).contiguous())

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               out: torch.Tensor | None = None) -> None:
        """Start the layer on the CPU workers; wait() returns [T, H] in x's dtype (`out` if given)."""
        if self._pending is not None:
            raise HybridMoEError("submit() called twice without wait(); call wait() first")
        try:  # _call's try inline here and in forward(): one Python call fewer per layer call
            if out is None:
                out = torch.empty_like(x)
            ticket = self._engine.submit(*_capsules(x, topk_ids, topk_weights, out))
        except (ValueError, TypeError) as e:
            raise _engine_error(e, x=x, topk_ids=topk_ids, topk_weights=topk_weights, out=out) from None
        # The engine reads these after submit returns: keep them alive until wait().
        self._pending = (ticket, out, x, topk_ids, topk_weights)

    def submit_deferred(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        deferred: int) -> None:
        """submit() of forward_deferred(): wait() then returns its two outputs (a tuple)."""
        if self._pending is not None:
            raise HybridMoEError("submit_deferred() called while a submit() is pending; call wait() first")
        ticket, outs = self._deferred_call(self._engine.submit_deferred, x, topk_ids, topk_weights, deferred)
        self._pending = (ticket, outs, x, topk_ids, topk_weights)

    def wait(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """submit()'s output [T, H] (submit_deferred's two)."""
        if self._pending is None:
            raise HybridMoEError("wait() called without a submit()")
        ticket, out = self._pending[:2]
        try:
            self._engine.wait(ticket)
        finally:
            self._pending = None  # only now may the inputs go
        return out

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]); x [T, H] bf16 or fp32.

        Returns `out` ([T, H], x's dtype, overwritten) if given, else a new tensor. Runs on the
        calling thread with the pool's workers (GIL released): no hand-off to the pool's driver
        thread, which submit()/wait() need to overlap with other work.
        """
        if self._pending is not None:
            raise HybridMoEError("forward() called between submit() and wait(); call wait() first")
        try:
            if out is None:
                out = torch.empty_like(x)
            self._engine.run(*_capsules(x, topk_ids, topk_weights, out))
        except (ValueError, TypeError) as e:
            raise _engine_error(e, x=x, topk_ids=topk_ids, topk_weights=topk_weights, out=out) from None
        return out

    __call__ = forward

    def forward_deferred(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, deferred: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() split by slot, in one pass over the weights: (the sum over each token's first K - deferred
        slots, the sum over its last `deferred`), both [T, H] in x's dtype. The first comes out complete before
        the experts only the deferred slots use are computed (expert deferral: experts/deferral.py; the CUDA
        handoff hands it to the GPU at that point)."""
        if self._pending is not None:
            raise HybridMoEError("forward_deferred() called between submit() and wait(); call wait() first")
        return self._deferred_call(self._engine.run_deferred, x, topk_ids, topk_weights, deferred)[1]

    def backward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, grad_out: torch.Tensor,
                 chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients of forward(x, topk_ids, topk_weights) through the frozen experts, given grad_out [T, H]
        (d loss / d out, bf16 or fp32): (grad_x [T, H] in x's dtype, grad_topk_weights [T, K] float32).

        Per (token t, slot k) with expert e and routing weight w: grad_topk_weights[t, k] = <grad_out[t], y_e(x[t])>
        (y_e with its down bias), and grad_x[t] = sum_k Wg_e^T dg + Wu_e^T du with dg, du the gradients of
        h = glu(gate x + b_gate, up x + b_up) (silu(g) * u by default, or set_glu's) for dh = w Wd_e^T grad_out[t].
        No gradient of the weights or biases is formed (frozen), so the router gets its gradient through
        grad_topk_weights. The arguments are forward()'s (checked the same way; topk_weights float32) and only
        they: the gate and up sums are recomputed here from x with the forward's kernels, so an autograd wrapper
        saves x, topk_ids and topk_weights and nothing else. Weights whose slot repeats an expert (weight 0
        padding) get their gradient too.

        Runs on the calling thread with the pool's workers (GIL released), tokens grouped by expert as the
        forward; each expert's weights are read once per pass. Sums in float32; the products read the expert
        weights as dequantized() gives them, every format. On the AVX-512 and AMX paths (AMX layers run the
        AVX-512 kernels here) they read grad_out, dg and du in bf16 and the weights rounded to bf16 (exact for bf16
        and mxfp4 weights) through bf16 dot products; on the generic and AVX2 paths in float32. x is read as the
        forward's few-token kernels read it (bf16 for bf16, fp8 and mxfp4 layers; int16 per row for int8 and int4,
        AMX layers included).

        chunk_tokens: tokens per pass (default: as many as 256 MiB of workspace hold); a call of more runs in
        several passes, each reading the weights of the experts its tokens use.
        """
        if self._pending is not None:
            raise HybridMoEError("backward() called between submit() and wait(); call wait() first")
        chunk = 0 if chunk_tokens is None else _int_arg("chunk_tokens", chunk_tokens, 1, _INT32_MAX)
        args = {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights, "grad_out": grad_out}
        for name, t in args.items():
            _check_tensor(name, t)
        x, topk_ids, topk_weights, grad_out = (t.detach() for t in args.values())
        try:
            grad_x = torch.empty_like(x)
            grad_weights = torch.empty(topk_weights.shape, dtype=torch.float32)
            x_, ids_, w_, grad_x_ = _capsules(x, topk_ids, topk_weights, grad_x)
            self._engine.backward(x_, ids_, w_, to_dlpack(grad_out), grad_x_, to_dlpack(grad_weights), chunk)
        except (ValueError, TypeError) as e:
            raise _engine_error(e, **args) from None
        return grad_x, grad_weights

    @staticmethod
    def _deferred_call(method, x, topk_ids, topk_weights, deferred: int):
        """method (the engine's run_deferred / submit_deferred) on new outputs: (what it returns, (out, out2))."""
        deferred = _int_arg("deferred", deferred, 0, _INT32_MAX)
        try:
            out, out2 = torch.empty_like(x), torch.empty_like(x)
            x_, ids_, w_, out_ = _capsules(x, topk_ids, topk_weights, out)
            return method(x_, ids_, w_, deferred, out_, to_dlpack(out2)), (out, out2)
        except (ValueError, TypeError) as e:
            raise _engine_error(e, x=x, topk_ids=topk_ids, topk_weights=topk_weights) from None

    def trace(self, calls: int) -> None:
        """Record the next `calls` forward()/submit() calls of this layer (off again after them).

        Costs nothing measurable when off; see take_trace() for what a record holds.
        """
        calls = _int_arg("calls", calls, -math.inf, math.inf)
        if not 0 <= calls <= _INT32_MAX:
            raise HybridMoEError(f"trace takes a number of calls between 0 and {_INT32_MAX}, got {calls}")
        self._engine.trace(calls)

    def take_trace(self) -> list[dict]:
        """The records of the traced calls since the last take, oldest first.

        Each: T, K, A (distinct experts); times in ns on time.monotonic_ns()'s clock: call_ns
        (submit/forward entered the engine), entry_ns (the layer started on its thread),
        grouped_ns, acts_ns (x rows quantized; with early_start, handed to the GEMM run), items_ns
        (GEMM run starts), gemm_end_ns, end_ns (combine done), ready_ns (with deferral: the own slots'
        output complete, else 0); items int64 [n, 11] per GEMM item: worker, down (0 gate/up, 1 down),
        expert, slice, b0, b1 (32-row blocks of the slice), start, end, wait (a down item waiting for its
        expert's h; with early_start, a gate/up item waiting for x's rows), convert (after end: the
        gate/up item that turned its expert's h into down activations; a down item summing the output
        columns it completed, up to 16 tokens), deferred (1: a deferred slot's expert);
        join_ns int64 [threads] (when each pool worker joined the GEMM run, 0: never) and slept
        bool [threads] (it had gone to sleep before).
        """
        return trace_records(self._engine.take_trace())

    @property
    def tuning(self) -> EngineTuning:
        """The schedule and prefetch knobs of this layer's later calls (tuning.py; the defaults unless tune())."""
        return from_native(self._engine.tuning)

    def tune(self, tuning: EngineTuning) -> None:
        """Every knob of `tuning` for this layer's later calls (between calls); results do not depend on it."""
        self._call(setattr, self._engine, "tuning", to_native(tuning, _native().MoeTuning))


def _capsules(x, topk_ids, topk_weights, out):
    """DLPack capsules of the four per-call arrays, which the engine checks exactly as tensors: a
    tensor's own __dlpack__ (Python code) costs ~4 us per array, torch's C
    to_dlpack ~0.25. What to_dlpack refuses (not a tensor, a meta or sparse one) raises
    HybridMoEError naming the argument."""
    try:
        return to_dlpack(x), to_dlpack(topk_ids), to_dlpack(topk_weights), to_dlpack(out)
    except (TypeError, RuntimeError, BufferError) as e:
        raise _engine_error(e, x=x, topk_ids=topk_ids, topk_weights=topk_weights, out=out) from None


def trace_records(raw: list[dict]) -> list[dict]:
    """A native engine's trace records (CpuExperts.take_trace, the CUDA handoff's take_trace) with their
    arrays as torch tensors: items and join_ns int64, slept bool."""
    return [{**rec, "items": torch.from_numpy(rec["items"]), "join_ns": torch.from_numpy(rec["join_ns"]),
             "slept": torch.from_numpy(rec["slept"]).bool()} for rec in raw]
