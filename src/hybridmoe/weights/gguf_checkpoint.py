"""A GGUF model read as a Hugging Face checkpoint: HF names, torch shapes, float tensors.

Each tensor is dequantized on read with gguf.quants (every block type that package reads: F32,
F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, IQ*, and gpt-oss's MXFP4), so a file that
mixes types per tensor (Q4_K_M) is read tensor by tensor. Routed experts are read one expert at a
time: an expert's rows of a stacked [E, I, H] tensor are one contiguous run of blocks. A DeepSeek
file whose kv_b_proj is split into attn_k_b + attn_v_b shows it as the one HF tensor again; a
gpt-oss file's experts show as the checkpoint's fused parts (gguf_fused_experts.py), read through
fused_experts(name) one expert at a time. A file whose experts fuse gate and up (ffn_gate_up_exps
[E, 2I, H], as llama.cpp's converter writes them with its fuse_gate_up_exps option: gate's I rows,
then up's) shows them as the two again. Qwen3-Next and Qwen3.5-MoE files (qwen3next, qwen35moe) show
their Gated DeltaNet tensors and their norms as the checkpoint's (gguf_linear_attention.py). A shared
expert's gate stored squeezed to [H] (older conversions squeeze every tensor) reads as the
checkpoint's [1, H].
The file is mapped; release(name) drops the pages a read touched, so a load never holds it resident.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from hybridmoe.errors import CheckpointError
from hybridmoe.models.registry import read_config_json
from hybridmoe.weights.gguf_file import GGUFFiles
from hybridmoe.weights.gguf_fused_experts import GptOssExpertParts, PartExperts
from hybridmoe.weights.gguf_linear_attention import HYBRID_ARCHS, HybridTensors, decoder_layers
from hybridmoe.weights.gguf_names import (
    expert_tensor,
    hf_name,
    join_kv_b,
    kv_b_part,
    mlp_name,
    unpermute_rows,
)
from hybridmoe.weights.mapped_pages import MappedPages

_EXPERT_NAME = {"block_sparse_moe": "model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
                "mlp": "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"}
_MIXTRAL_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}
_SHARED_GATE = ".shared_expert_gate.weight"


class GGUFCheckpoint:
    def __init__(self, gguf: GGUFFiles):
        self.gguf = gguf
        self.arch = gguf.metadata.get("general.architecture")
        if self.arch is not None and not isinstance(self.arch, str):
            raise CheckpointError(f"{gguf.paths[0]}: GGUF metadata general.architecture must be a string, got "
                                  f"{self.arch!r:.40}")
        mlp = mlp_name(self.arch)
        self._where: dict[str, tuple[str, int | None]] = {}  # HF name -> (GGUF name, expert or None)
        self._file: dict[str, str] = {}
        self._kv_b: dict[str, tuple[str, str]] = {}  # HF kv_b_proj name -> (attn_k_b, attn_v_b) GGUF names
        self._half: dict[str, int] = {}  # HF name of a fused gate_up expert's gate (0) or up (1) -> its half
        self._fused = GptOssExpertParts({n: gguf.shape(n) for n in gguf.tensors}, self._read, gguf.paths[0]) \
            if self.arch == "gpt-oss" else None
        self._hybrid = HybridTensors(gguf, self.arch, decoder_layers(gguf, self.arch), lambda n: self._read(n, None)) \
            if self.arch in HYBRID_ARCHS else None
        self._views = [v for v in (self._fused, self._hybrid) if v is not None]
        for name, (tensor, path) in gguf.tensors.items():
            if any(v.takes(name) for v in self._views):
                continue
            key = expert_tensor(name)
            if key is not None:
                self._add_experts(name, *key, mlp, path)
                continue
            layer = kv_b_part(name)
            if layer is not None:
                self._add_kv_b_half(layer, name, path)
                continue
            target = hf_name(name, self.arch)
            # unknown tensors keep their GGUF name, so the loader reports them as not part of the model
            self._add(target or name, name, None, path)
        for view in self._views:
            for hf in view.parts:
                first = view.sources(hf)[0]
                self._add(hf, first, None, gguf.tensors[first][1])
        self.heads = (gguf.metadata.get(f"{self.arch}.attention.head_count"),
                      gguf.metadata.get(f"{self.arch}.attention.head_count_kv"))
        self._pages = MappedPages()

    def _add(self, hf: str, gguf_name: str, expert: int | None, path: Path) -> None:
        self._where[hf] = (gguf_name, expert)
        self._file[hf] = path.name

    def _add_experts(self, gguf_name: str, layer: int, proj: str, mlp: str, path: Path) -> None:
        """Every expert of a stacked expert tensor under its checkpoint name; a fused gate_up as gate and up."""
        for half, part in enumerate(("gate", "up") if proj == "gate_up" else (proj,)):
            spelled = _MIXTRAL_PROJ[part] if mlp == "block_sparse_moe" else part
            for e in range(self.gguf.shape(gguf_name)[0]):
                hf = _EXPERT_NAME[mlp].format(layer=layer, expert=e, proj=spelled)
                self._add(hf, gguf_name, e, path)
                if proj == "gate_up":
                    self._half[hf] = half

    def _view(self, name: str) -> GptOssExpertParts | HybridTensors | None:
        return next((v for v in self._views if name in v.parts), None)

    def _add_kv_b_half(self, layer: int, gguf_name: str, path: Path) -> None:
        hf = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        k_b, v_b = f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"
        if hf in self._where or f"blk.{layer}.attn_kv_b.weight" in self.gguf.tensors:
            return  # a file that also keeps the whole attn_kv_b: read that one
        if k_b not in self.gguf.tensors or v_b not in self.gguf.tensors:
            raise CheckpointError(f"GGUF layer {layer} has {gguf_name} without its other half "
                                  f"({v_b if gguf_name == k_b else k_b}); the file is incomplete")
        self._kv_b[hf] = (k_b, v_b)
        self._add(hf, k_b, None, path)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> GGUFCheckpoint:
        source = json.loads((Path(model_dir) / "gguf_source.json").read_text())
        read_config_json(model_dir)
        return cls(GGUFFiles(source["files"][0]))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def names_by_file(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {p.name: [] for p in self.gguf.paths}
        for name, file in self._file.items():
            out[file].append(name)
        return {f: sorted(n) for f, n in out.items()}

    def nbytes(self) -> int:
        return self.gguf.nbytes()

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return self.gguf.tensors[self._where[name][0]][0].tensor_type

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._kv_b:
            (heads, rank, nope), (_, v_dim, _) = (self.gguf.shape(n) for n in self._kv_b[name])
            return heads * (nope + v_dim), rank
        view = self._view(name)
        if view is not None:
            return view.shape(name)
        gguf_name, expert = self._where[name]
        shape = self.gguf.shape(gguf_name)
        if name in self._half:
            return shape[1] // 2, *shape[2:]
        if name.endswith(_SHARED_GATE) and len(shape) == 1:
            return 1, shape[0]
        return shape[1:] if expert is not None else shape

    def get(self, name: str) -> torch.Tensor:
        """float32, in torch shape."""
        if name in self._kv_b:
            return join_kv_b(*(self._read(n, None) for n in self._kv_b[name]))
        view = self._view(name)
        if view is not None:
            return view.get(name)
        w = self._read(*self._where[name])
        if name in self._half:
            return w.chunk(2)[self._half[name]]
        if name.endswith(_SHARED_GATE):
            return w.reshape(1, -1)
        if self.arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            n_head = self.heads[0] if "q_proj" in name else (self.heads[1] or self.heads[0])
            if type(n_head) is not int or n_head < 1 or w.shape[0] % (2 * n_head):
                raise CheckpointError(f"GGUF metadata llama.attention.head_count(_kv) {n_head!r:.40} does not split "
                                      f"the {w.shape[0]} rows of {name} into heads")
            w = unpermute_rows(w, n_head)
        return w

    def fused_experts(self, name: str) -> PartExperts | torch.Tensor:
        """A gpt-oss fused expert part as a sequence of its experts, each read when indexed; any other tensor whole."""
        if self._fused is not None and name in self._fused.parts:
            return self._fused.experts(name)
        return self.get(name)

    def release(self, name: str) -> None:
        """Drop the mapped pages that get(name) read from this process's RSS, once the caller has copied or
        packed the tensor (SafetensorsCheckpoint.release does the same)."""
        if name in self._kv_b:
            sources = [(n, None) for n in self._kv_b[name]]
        elif self._view(name) is not None:
            sources = [(n, None) for n in self._view(name).sources(name)]
        else:
            sources = [self._where[name]]
        for gguf_name, expert in sources:
            data = self._data(gguf_name, expert)
            self._pages.release(self.gguf.tensors[gguf_name][1], data.ctypes.data, data.nbytes)

    def _data(self, gguf_name: str, expert: int | None) -> np.ndarray:
        """The tensor's (or one expert's) blocks: a view of the mapped file."""
        data = self.gguf.tensors[gguf_name][0].data
        return np.asarray(data if expert is None else data[expert])

    def _read(self, gguf_name: str, expert: int | None) -> torch.Tensor:
        """One GGUF tensor (or one expert of a stacked one) dequantized to float32, in torch shape."""
        tensor = self.gguf.tensors[gguf_name][0]
        try:
            values = dequantize(self._data(gguf_name, expert), tensor.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise CheckpointError(f"GGUF tensor {gguf_name} of type {tensor.tensor_type.name} cannot be read "
                                  f"({e or 'no dequantizer in this gguf package'})") from None
        shape = self.gguf.shape(gguf_name)
        # a copy: the file is mapped read-only
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape[1:] if expert is not None else shape)
