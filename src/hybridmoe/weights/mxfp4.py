"""MXFP4 routed experts (config.json quantization_config quant_method "mxfp4"), as the gpt-oss releases ship them.

A fused expert tensor X of float shape [E, in, out] (gpt-oss: mlp.experts.gate_up_proj [E, H, 2I], down_proj
[E, I, H]) is stored as two uint8 tensors, per expert the transpose W [out, in] in blocks of 32 input channels:
  X_blocks [E, out, in / 32, 16]  two e2m1 codes a byte, low nibble first: byte j of block g holds input channels
                                  32g + 2j (bits 0-3) and 32g + 2j + 1 (bits 4-7)
  X_scales [E, out, in / 32]      the block's e8m0 exponent s: its scale is 2^(s - 127)
and W[o, i] = E2M1[code] * 2^(s - 127), E2M1 the 16 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code
bit 3 is the sign; experts/mxfp4_codes.py decodes them). transformers' integrations/mxfp4.py reads the same layout.
The biases and every other tensor (modules_to_not_convert: attention, router, embeddings, lm_head) are float; which
fused tensors are MXFP4 is read from the files (an X_blocks beside its X_scales), so a float X is read as it is.

Mxfp4Checkpoint shows each X_blocks + X_scales pair to the loader as the float tensor X, with X's shape: the loader
checks it against config.json and the model splits its experts as it splits a float checkpoint's (gpt-oss: the
interleaved gate/up). Through fused_experts(X) an expert is decoded only when the loader asks for it, so a load holds
one expert in float beside what the backend has taken, never a layer or the model; a backend that takes MXFP4 codes
(the native engine's mxfp4 format, expert_format "auto" for these checkpoints) gets each expert's codes and scales
as they are (Mxfp4Experts.codes), never a float weight. The decoding is exact in float32 (an e2m1 value times a
power of two from 2^-128 up is a float32) but where a value overflows: nonzero codes under the largest scales (255,
2^128, the OCP spec's NaN, read as transformers reads it) are inf, which the loader's finite check refuses, naming
the tensor; the codes handed to the native engine are checked for scales its mxfp4 format does not hold
(weights/fused_experts.py, experts/mxfp4_codes.py unheld_scales).

The float experts go to the backend in the model's dtype: the torch expert backend takes them as they are, the native
CPU engine packs them into its format (expert_format).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridmoe.errors import CheckpointError
from hybridmoe.experts.mxfp4_codes import BLOCK, dequantize_mxfp4
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

BLOCKS, SCALES = "_blocks", "_scales"


class Mxfp4Experts:
    """One fused MXFP4 tensor's experts, each decoded when indexed."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor):
        self.blocks, self.scales = blocks, scales  # views of the mapped files: nothing read yet

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, expert: int) -> torch.Tensor:
        """Expert `expert` as the float checkpoint stores it: [in, out] float32 (a transposed view of W)."""
        return dequantize_mxfp4(self.blocks[expert], self.scales[expert]).t()

    def codes(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `expert`'s codes [in / 2, out] and scales [in / 32, out] uint8, transposed views of the mapped
        file laid out as the float [in, out] is along out: a split of the float tensor's out dimension (gpt-oss's
        gate/up columns) applies to them as it is."""
        blocks, scales = self.blocks[expert], self.scales[expert]  # [out, G, 16], [out, G]
        return blocks.reshape(blocks.shape[0], -1).t(), scales.t()


class Mxfp4Checkpoint:
    """The safetensors files of model_dir with each MXFP4 pair X_blocks, X_scales named as the float tensor X.

    Every pair's header is checked when the checkpoint opens (before any weight is copied): both uint8, the blocks
    [E, out, G, 16] and the scales [E, out, G]; one line names the tensor that does not fit."""

    def __init__(self, model_dir: str | Path):
        self._ckpt = SafetensorsCheckpoint(model_dir)
        try:
            self._fused = self._pairs()  # X -> X_blocks, for each MXFP4 pair
        except BaseException:
            self._ckpt.__exit__(None, None, None)
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._ckpt.__exit__(*exc)

    def _pairs(self) -> dict[str, str]:
        ckpt, pairs = self._ckpt, {}
        for name in ckpt.file_of:
            if not name.endswith(BLOCKS):
                continue
            base = name[: -len(BLOCKS)]
            scales = base + SCALES
            if scales not in ckpt.file_of:
                raise CheckpointError(f"MXFP4 tensor {name} has no {scales} beside it in {ckpt.model_dir}")
            if base in ckpt.file_of:
                raise CheckpointError(f"tensor {base} is in {ckpt.model_dir} both as float and as MXFP4 ({name})")
            for part in (name, scales):
                if ckpt.dtype(part) != torch.uint8:
                    got = str(ckpt.dtype(part) or "of no torch dtype").removeprefix("torch.")
                    raise CheckpointError(f"MXFP4 tensor {part} has dtype {got}, expected uint8")
            shape, scale_shape = ckpt.shape(name), ckpt.shape(scales)
            if len(shape) != 4 or shape[-1] != BLOCK // 2:
                raise CheckpointError(f"MXFP4 tensor {name} has shape {list(shape)}, expected [experts, rows, "
                                      f"blocks, {BLOCK // 2}] ({BLOCK} e2m1 values in {BLOCK // 2} bytes a block)")
            if scale_shape != shape[:-1]:
                raise CheckpointError(f"MXFP4 tensor {scales} has shape {list(scale_shape)}, expected "
                                      f"{list(shape[:-1])} (one e8m0 scale per {BLOCK} values of {name})")
            pairs[base] = name
        return pairs

    def names_by_file(self) -> dict[str, list[str]]:
        """Each file's tensor names, an MXFP4 pair shown once as X (in the file of its X_blocks)."""
        scales = {base + SCALES for base in self._fused}
        shown = {blocks: base for base, blocks in self._fused.items()}
        return {file: sorted(shown.get(n, n) for n in names if n not in scales)
                for file, names in self._ckpt.names_by_file().items()}

    def nbytes(self) -> int:
        return self._ckpt.nbytes()

    def shape(self, name: str) -> tuple[int, ...]:
        """The float shape: an MXFP4 X [E, out, G, 16] is X [E, G * 32, out]."""
        if name not in self._fused:
            return self._ckpt.shape(name)
        experts, out, groups, _ = self._ckpt.shape(self._fused[name])
        return experts, groups * BLOCK, out

    def fused_experts(self, name: str) -> Mxfp4Experts | torch.Tensor:
        """The fused tensor `name` as a sequence of its experts ([in, out] float each): an MXFP4 one decodes an
        expert when it is indexed, a float one is the tensor."""
        if name not in self._fused:
            return self._ckpt.get(name)
        return Mxfp4Experts(self._ckpt.get(self._fused[name]), self._ckpt.get(name + SCALES))

    def get(self, name: str) -> torch.Tensor:
        """The tensor in float: an MXFP4 one decoded whole (the loader reads those per expert, fused_experts)."""
        if name not in self._fused:
            return self._ckpt.get(name)
        experts = self.fused_experts(name)
        return dequantize_mxfp4(experts.blocks, experts.scales).transpose(1, 2)

    def release(self, name: str) -> None:
        """Drop the mapped pages that reading `name` touched (an MXFP4 X's blocks and scales)."""
        for part in [self._fused[name], name + SCALES] if name in self._fused else [name]:
            self._ckpt.release(part)
