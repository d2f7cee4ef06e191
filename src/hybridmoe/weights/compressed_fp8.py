"""compressed-tensors FP8 checkpoints (quant_method "compressed-tensors", format "float-quantized"), as
llm-compressor writes them (schemes FP8_BLOCK, FP8_DYNAMIC, FP8): a quantized linear X stores

    X.weight        float8_e4m3fn [out, in]
    X.weight_scale  float         [ceil(out / 128), ceil(in / 128)]  strategy "block" (block_structure 128x128)
                                  [out, 1]                           strategy "channel"
                                  [1] or []                          strategy "tensor"

and W = weight * weight_scale over the scale's block. That is DeepSeek-V3's block FP8 with the scale under another
name: the same reader serves both (weights/safetensors.py), and 128x128 blocks go to the native fp8 expert format
as stored. The checkpoint's activation quantization (dynamic per token or group, or a static X.input_scale) is a
serving engine's way to use FP8 matrix units; the engine here computes activations in the model's dtype, more
precisely than that, and reads no input_scale.

Any other variant (integer weights in float-quantized format, asymmetric scales, group strategies, a quantized KV
cache, sparsity, transforms) fails with one line naming it.
"""

from __future__ import annotations

from hybridmoe.errors import CheckpointError
from hybridmoe.weights.compressed_tensors import config_groups

FORMAT = "float-quantized"
SCALE_SUFFIX = "_scale"
"""X.weight's scale is X.weight_scale."""
IGNORED_SUFFIXES = (".input_scale",)
"""Static activation scales, which the engine does not use (module doc)."""


def _unsupported(what: str) -> CheckpointError:
    return CheckpointError(f"compressed-tensors checkpoint with {what} is not supported; supported FP8: format "
                           f"{FORMAT!r}, symmetric 8-bit float weights per 128x128 block, channel or tensor")


def _weights_block(name: str, group) -> tuple[int, int]:
    """One config group's weight scale block: (rows, columns), 0 standing for the whole dimension."""
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise _unsupported(f"no weight quantization in config group {name!r}")
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise _unsupported(f"{weights.get('num_bits')}-bit {weights.get('type')} weights (config group {name!r})")
    if weights.get("symmetric") is False:
        raise _unsupported(f"asymmetric weights (config group {name!r})")
    if weights.get("dynamic"):
        raise _unsupported(f"dynamic weight quantization (config group {name!r})")
    strategy = weights.get("strategy")
    if strategy == "channel":
        return (1, 0)
    if strategy == "tensor":
        return (0, 0)
    if strategy == "block":
        block = weights.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
            raise _unsupported(f"block_structure {block!r} (config group {name!r})")
        return (block[0], block[1])
    raise _unsupported(f"the weight strategy {strategy!r} (config group {name!r})")


def float_quantized_block(quantization_config: dict) -> tuple[int, int] | None:
    """The weight scales' block of a compressed-tensors FP8 checkpoint, (rows, columns) with 0 for a whole
    dimension; None for any other checkpoint; a CheckpointError for a variant not read (module doc)."""
    qc = quantization_config
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != FORMAT:
        return None
    blocks = {_weights_block(name, group) for name, group in config_groups(qc, _unsupported).items()}
    if len(blocks) > 1:
        raise _unsupported(f"config groups of different weight scale blocks ({sorted(blocks)})")
    return blocks.pop()
