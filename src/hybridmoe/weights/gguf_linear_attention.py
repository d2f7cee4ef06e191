"""Qwen3-Next (qwen3next) and Qwen3.5-MoE (qwen35moe) GGUF files read back as their Hugging Face checkpoints.

llama.cpp's converter (convert_hf_to_gguf.py: Qwen3NextModel, and for Qwen3.5 the same class under
_LinearAttentionVReorderBase) changes these tensors on the way into the file; each change is undone here:
  - every RMSNorm weight but the Gated DeltaNet's output norm is stored as 1 + weight (transformers scales by
    1 + weight, llama.cpp by the weight): attn_norm, post_attention_norm, attn_q_norm, attn_k_norm and output_norm
    get 1 subtracted; ssm_norm (linear_attn.norm) is kept;
  - A_log is stored as ssm_a = -exp(A_log), read back as log(-ssm_a); dt_bias is ssm_dt.bias;
  - conv1d.weight [C, 1, Kc] is stored squeezed to [C, Kc];
  - Qwen3-Next's in_proj_qkvz (per key head: q, k, v, z) is stored as it is (ssm_in, older conversions) or split into
    attn_qkv (every head's q, then every head's k, then every value head's v) and attn_gate (z), which are
    interleaved back per key head; in_proj_ba is ssm_ba, as it is;
  - Qwen3.5's split projections are attn_qkv (in_proj_qkv), attn_gate (in_proj_z), ssm_beta (in_proj_b) and ssm_alpha
    (in_proj_a). Where a key head serves r > 1 value heads, the converter reorders the value heads from grouped by
    key head (k0v0, k0v1, k1v0, k1v1) to tiled (k0v0, k1v0, k0v1, k1v1), the order ggml's broadcast of the key heads
    reads them in, wherever they appear: the v rows of in_proj_qkv and the v channels of conv1d, the rows of in_proj_z,
    in_proj_b and in_proj_a, A_log, dt_bias and the columns of out_proj. They are put back in grouped order.
  - the shared expert's gate [1, H] is kept 2-D by newer conversions, squeezed to [H] by older ones; both read as
    [1, H] (gguf_checkpoint.py).
Qwen3-Next's rows go unreordered: llama.cpp repeats each key head for its r value heads, the checkpoint's order.

Which layers are Gated DeltaNet comes from {arch}.attention.recurrent_layers when the file has it, else every
{arch}.full_attention_interval-th layer (4 when absent) is full attention, as llama.cpp reads them. A
multi-token-prediction block past the decoder layers ({arch}.nextn_predict_layers of them) is named under "mtp.",
which the models skip.

K key heads, V value heads (r = V / K each), dk and dv their sizes, C = 2 K dk + V dv channels, H hidden.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridmoe.errors import CheckpointError
from hybridmoe.weights.gguf_file import GGUFFiles

HYBRID_ARCHS = ("qwen3next", "qwen35moe")
"""GGUF architectures whose layers are Gated DeltaNet or gated attention."""

DEFAULT_FULL_ATTENTION_INTERVAL = 4
"""llama.cpp's period of full-attention layers when the file names none."""

_SHIFTED_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                  "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
"""A layer's (1 + weight) norms, stored with the 1 added -> their module."""

_LINEAR_PARTS = ("ssm_in", "ssm_ba", "ssm_beta", "ssm_alpha", "ssm_conv1d", "ssm_dt", "ssm_a", "ssm_norm", "ssm_out",
                 "attn_qkv", "attn_gate")
"""A Gated DeltaNet layer's GGUF tensors (blk.N.<part>.weight, ssm_dt.bias, ssm_a bare)."""

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass(frozen=True)
class DeltaNetDims:
    """The Gated DeltaNet's head counts and sizes, from the {arch}.ssm.* keys."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @property
    def per_key(self) -> int:
        return self.value_heads // self.key_heads

    @property
    def key_width(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def value_width(self) -> int:
        return self.value_heads * self.value_dim


def _count_key(gguf: GGUFFiles, key: str) -> int:
    value = gguf.metadata.get(key)
    if value is None:
        raise CheckpointError(f"{gguf.paths[0]} lacks the metadata key {key}")
    if type(value) is not int or value < 1:
        raise CheckpointError(f"{gguf.paths[0]}: GGUF metadata {key} must be a positive count, got {value!r:.40}")
    return value


def delta_net_dims(gguf: GGUFFiles, arch: str) -> DeltaNetDims:
    """ssm.group_count key heads of ssm.state_size, ssm.time_step_rank value heads sharing ssm.inner_size."""
    key_heads, value_heads = _count_key(gguf, f"{arch}.ssm.group_count"), _count_key(gguf, f"{arch}.ssm.time_step_rank")
    key_dim, inner = _count_key(gguf, f"{arch}.ssm.state_size"), _count_key(gguf, f"{arch}.ssm.inner_size")
    if value_heads % key_heads or inner % value_heads:
        raise CheckpointError(f"{gguf.paths[0]}: GGUF metadata {arch}.ssm.time_step_rank {value_heads} must be a "
                              f"multiple of ssm.group_count {key_heads} and divide ssm.inner_size {inner}")
    return DeltaNetDims(key_heads, value_heads, key_dim, inner // value_heads)


def decoder_layers(gguf: GGUFFiles, arch: str) -> int:
    """{arch}.block_count less the multi-token-prediction blocks it counts ({arch}.nextn_predict_layers)."""
    blocks, nextn = _count_key(gguf, f"{arch}.block_count"), gguf.metadata.get(f"{arch}.nextn_predict_layers", 0)
    if type(nextn) is not int or not 0 <= nextn < blocks:
        raise CheckpointError(f"{gguf.paths[0]}: GGUF metadata {arch}.nextn_predict_layers must be a count below "
                              f"block_count {blocks}, got {nextn!r:.40}")
    return blocks - nextn


def recurrent_layers(gguf: GGUFFiles, arch: str, layers: int) -> list[bool]:
    """Whether each decoder layer is Gated DeltaNet: attention.recurrent_layers (a bool per layer, or one for all;
    layers past the array's end attend), else all but every full_attention_interval-th layer."""
    path, key = gguf.paths[0], f"{arch}.attention.recurrent_layers"
    flags = gguf.metadata.get(key)
    if isinstance(flags, list) and all(isinstance(f, bool) for f in flags):
        return [bool(f) for f in flags[:layers]] + [False] * max(0, layers - len(flags))
    if isinstance(flags, bool):
        return [flags] * layers
    if flags is not None:
        raise CheckpointError(f"{path}: GGUF metadata {key} must be a bool or an array of bools, got {flags!r:.40}")
    key = f"{arch}.full_attention_interval"
    every = gguf.metadata.get(key, DEFAULT_FULL_ATTENTION_INTERVAL)
    if type(every) is not int or every < 1:
        raise CheckpointError(f"{path}: GGUF metadata {key} must be a positive count, got {every!r:.40}")
    return [(i + 1) % every != 0 for i in range(layers)]


def grouped_value_heads(t: torch.Tensor, dim: int, dims: DeltaNetDims, head_size: int) -> torch.Tensor:
    """Undo the converter's value-head reorder along dim: (r, K, head_size) -> (K, r, head_size)."""
    shape = t.shape
    t = t.reshape(*shape[:dim], dims.per_key, dims.key_heads, head_size, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def qkvz_per_key_head(qkv: torch.Tensor, z: torch.Tensor, dims: DeltaNetDims) -> torch.Tensor:
    """attn_qkv [C, H] (q, k, v each over all heads) and attn_gate [V dv, H] -> Qwen3-Next's in_proj_qkvz
    [C + V dv, H]: per key head its q, k, its r value heads' v, then their z."""
    heads, hidden = dims.key_heads, qkv.shape[-1]
    q, k, v = qkv.split([dims.key_width, dims.key_width, dims.value_width])
    parts = [q.reshape(heads, -1, hidden), k.reshape(heads, -1, hidden), v.reshape(heads, -1, hidden),
             z.reshape(heads, -1, hidden)]
    return torch.cat(parts, dim=1).reshape(-1, hidden)


@dataclass(frozen=True)
class _Part:
    sources: tuple[str, ...]
    shape: tuple[int, ...]
    join: Callable[..., torch.Tensor]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _less_one(t: torch.Tensor) -> torch.Tensor:
    return t - 1


class HybridTensors:
    """The tensors of a qwen3next or qwen35moe file that differ from their checkpoint's, under the checkpoint's names
    and shapes; read(GGUF name) gives a whole GGUF tensor in float32.

    Every Gated DeltaNet tensor, every shifted norm and the multi-token-prediction block are taken here (takes());
    the rest of the file (embedding, attention projections, router, experts) keeps the generic naming."""

    def __init__(self, gguf: GGUFFiles, arch: str, layers: int, read: Callable[[str], torch.Tensor]):
        self.gguf, self.arch, self.read = gguf, arch, read
        self.dims = delta_net_dims(gguf, arch)
        self.parts: dict[str, _Part] = {}
        self._taken: set[str] = set()
        recurrent = recurrent_layers(gguf, arch, layers)
        by_layer: dict[int, dict[str, str]] = {}
        for name in gguf.tensors:
            m = _LAYER_TENSOR.fullmatch(name)
            if m is not None:
                by_layer.setdefault(int(m.group(1)), {})[m.group(2).removesuffix(".weight")] = name
        if "output_norm.weight" in gguf.tensors:
            self._add("model.norm.weight", ("output_norm.weight",), _less_one)
        for layer, tensors in sorted(by_layer.items()):
            if layer >= layers:  # the multi-token-prediction block
                for name in tensors.values():
                    self._add(f"mtp.{name}", (name,), _same)
                continue
            prefix = f"model.layers.{layer}."
            for part, module in _SHIFTED_NORMS.items():
                if part in tensors:
                    self._add(f"{prefix}{module}.weight", (tensors[part],), _less_one)
            linear = {p: tensors[p] for p in (*_LINEAR_PARTS, "ssm_dt.bias") if p in tensors}
            if linear and not recurrent[layer]:
                self._attention_layer_error(layer, linear)
            if linear:
                self._linear_layer(prefix + "linear_attn.", linear)

    def _attention_layer_error(self, layer: int, linear: dict[str, str]) -> None:
        if set(linear) == {"attn_qkv"}:
            raise CheckpointError(f"{self.gguf.paths[0]}: full-attention layer {layer} stores q, k and v fused as "
                                  f"{linear['attn_qkv']}, which llama.cpp's converter does not write; not read here")
        raise CheckpointError(f"{self.gguf.paths[0]}: layer {layer} holds {next(iter(linear.values()))}, a Gated "
                              f"DeltaNet tensor, but the metadata ({self.arch}.full_attention_interval or "
                              "attention.recurrent_layers) makes it a full-attention layer")

    def _add(self, hf: str, sources: tuple[str, ...], join: Callable[..., torch.Tensor],
             shape: tuple[int, ...] | None = None) -> None:
        self.parts[hf] = _Part(sources, shape or self.gguf.shape(sources[0]), join)
        self._taken.update(sources)

    def _need(self, linear: dict[str, str], part: str, beside: str) -> str:
        if part not in linear:
            missing = f"{linear[beside].rpartition('.' + beside)[0]}.{part}.weight"
            raise CheckpointError(f"{self.gguf.paths[0]} has {linear[beside]} without {missing}; the file is "
                                  "incomplete")
        return linear[part]

    def _linear_layer(self, prefix: str, linear: dict[str, str]) -> None:
        """One Gated DeltaNet layer's parts (linear: its GGUF tensors by part)."""
        d = self.dims
        tiled = self.arch == "qwen35moe"

        def heads(dim: int, size: int) -> Callable[[torch.Tensor], torch.Tensor]:
            return (lambda t: grouped_value_heads(t, dim, d, size)) if tiled else _same

        if "ssm_conv1d" in linear:
            channels, kernel = self.gguf.shape(linear["ssm_conv1d"])
            self._add(prefix + "conv1d.weight", (linear["ssm_conv1d"],),
                      lambda t: self._conv_channels(t, tiled).unsqueeze(1), (channels, 1, kernel))
        if "ssm_dt.bias" in linear:
            self._add(prefix + "dt_bias", (linear["ssm_dt.bias"],), heads(0, 1))
        if "ssm_a" in linear:
            name = linear["ssm_a"]
            self._add(prefix + "A_log", (name,), lambda t: heads(0, 1)(self._a_log(name, t)))
        if "ssm_norm" in linear:
            self._add(prefix + "norm.weight", (linear["ssm_norm"],), _same)
        if "ssm_out" in linear:
            self._add(prefix + "out_proj.weight", (linear["ssm_out"],), heads(1, d.value_dim))
        if self.arch == "qwen3next":
            self._qwen3next_projections(prefix, linear)
            return
        for part, module, rows in (("attn_gate", "in_proj_z", d.value_dim), ("ssm_beta", "in_proj_b", 1),
                                   ("ssm_alpha", "in_proj_a", 1)):
            if part in linear:
                self._add(f"{prefix}{module}.weight", (linear[part],), heads(0, rows))
        if "attn_qkv" in linear:
            self._add(prefix + "in_proj_qkv.weight", (linear["attn_qkv"],), lambda t: self._conv_channels(t, True))

    def _qwen3next_projections(self, prefix: str, linear: dict[str, str]) -> None:
        """in_proj_qkvz from ssm_in as it is, or from attn_qkv + attn_gate; in_proj_ba from ssm_ba as it is."""
        if "ssm_ba" in linear:
            self._add(prefix + "in_proj_ba.weight", (linear["ssm_ba"],), _same)
        if "ssm_in" in linear:
            self._add(prefix + "in_proj_qkvz.weight", (linear["ssm_in"],), _same)
        if "attn_qkv" in linear or "attn_gate" in linear:
            qkv = self._need(linear, "attn_qkv", "attn_gate")
            gate = self._need(linear, "attn_gate", "attn_qkv")
            rows, hidden = self.gguf.shape(qkv)
            self._add(prefix + "in_proj_qkvz.weight", (qkv, gate), lambda a, b: qkvz_per_key_head(a, b, self.dims),
                      (rows + self.gguf.shape(gate)[0], hidden))

    def _conv_channels(self, t: torch.Tensor, tiled: bool) -> torch.Tensor:
        """conv1d's channels or in_proj_qkv's rows (q, k, v): the v part back in grouped order where it was tiled."""
        if not tiled:
            return t
        qk = 2 * self.dims.key_width
        return torch.cat((t[:qk], grouped_value_heads(t[qk:], 0, self.dims, self.dims.value_dim)))

    def _a_log(self, name: str, ssm_a: torch.Tensor) -> torch.Tensor:
        if bool((ssm_a > 0).any()):
            raise CheckpointError(f"{self.gguf.paths[0]}: GGUF tensor {name} holds positive values; it stores "
                                  "-exp(A_log), which is negative")
        return torch.log(-ssm_a)

    def takes(self, gguf_name: str) -> bool:
        """Whether gguf_name is read through one of the parts here."""
        return gguf_name in self._taken

    def shape(self, name: str) -> tuple[int, ...]:
        return self.parts[name].shape

    def get(self, name: str) -> torch.Tensor:
        part = self.parts[name]
        return part.join(*(self.read(s) for s in part.sources)).reshape(part.shape)

    def sources(self, name: str) -> tuple[str, ...]:
        return self.parts[name].sources
