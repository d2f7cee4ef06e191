"""A small Qwen3-MoE GGUF file of several tensor types, and the byte positions of its tensor table's entries.

Imported by the test files beside it (the GGUF header checks and the reader fuzz).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from gguf_writer import random_kquant

TENSORS = ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight",
           "output_norm.weight")
"""In file order: F16 [8, 32], Q8_0 [4, 64], Q4_0 [2 experts, 4, 32], Q4_K [2 experts, 4, 256], F32 [32]."""


METADATA = {"block_count": 1, "context_length": 64, "embedding_length": 32, "attention.head_count": 4,
            "attention.head_count_kv": 2, "rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-6,
            "expert_count": 2, "expert_used_count": 1, "expert_feed_forward_length": 4}
"""The qwen3moe.* keys written (uint32, float32, or a string where a test passes one)."""


def write_small_gguf(path: Path, **metadata) -> None:
    """metadata: METADATA entries to replace, e.g. block_count="1" (key dots as in METADATA)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    add = {int: w.add_uint32, float: w.add_float32, str: w.add_string}
    for key, value in {**METADATA, **metadata}.items():
        add[type(value)](f"qwen3moe.{key}", value)
    w.add_token_list([f"t{i}" for i in range(8)])
    w.add_token_types([1] * 8)
    w.add_tensor(TENSORS[0], rng.standard_normal((8, 32)).astype(np.float16))
    w.add_tensor(TENSORS[1], quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor(TENSORS[2], quantize(rng.standard_normal((2, 4, 32)).astype(np.float32), Q.Q4_0), raw_dtype=Q.Q4_0)
    w.add_tensor(TENSORS[3], random_kquant(8, 256, Q.Q4_K, rng).reshape(2, 4, -1), raw_dtype=Q.Q4_K)
    w.add_tensor(TENSORS[4], np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def table_entry(raw: bytes, name: str) -> tuple[int, int, int]:
    """(position of the first dimension, of the type, of the offset) of tensor name's entry in the tensor table:
    name (u64 length + bytes), n_dims (u32), dims (u64 each), type (u32), offset (u64)."""
    at = raw.index(len(name).to_bytes(8, "little") + name.encode()) + 8 + len(name)
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    dims = at + 4
    return dims, dims + 8 * n_dims, dims + 8 * n_dims + 4


def data_start(raw: bytes) -> int:
    """Where the data section starts: after the last tensor-table entry, rounded up to the alignment."""
    _, _, offset_at = table_entry(raw, TENSORS[-1])
    return -(-(offset_at + 8) // gguf.GGUF_DEFAULT_ALIGNMENT) * gguf.GGUF_DEFAULT_ALIGNMENT
