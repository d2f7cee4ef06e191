"""A GGUF tensor table whose type, shape or offset does not match the data fails at open with one line naming
the tensor, instead of reading a neighbour's bytes; so does a metadata array longer than the file, and a
metadata value of the wrong type or out of range fails the config with one line naming the key."""

import pytest
from gguf import GGMLQuantizationType as Q
from small_gguf import TENSORS, table_entry, write_small_gguf

from hybridmoe.errors import CheckpointError
from hybridmoe.weights.gguf_checkpoint import GGUFCheckpoint
from hybridmoe.weights.gguf_config import hf_config
from hybridmoe.weights.gguf_file import GGUFFiles

EMBD, ATTN_Q, GATE_EXPS, DOWN_EXPS, NORM = TENSORS


@pytest.fixture
def path(tmp_path):
    path = tmp_path / "model.gguf"
    write_small_gguf(path)
    return path


def patch(path, name, field, value):
    """Set tensor name's first dimension, type or offset ("dim0", "type", "offset") in the tensor table."""
    raw = bytearray(path.read_bytes())
    at = dict(zip(("dim0", "type", "offset"), table_entry(raw, name)))[field]
    size = 4 if field == "type" else 8
    raw[at:at + size] = int(value).to_bytes(size, "little")
    path.write_bytes(bytes(raw))


def offset_of(path, name):
    raw = path.read_bytes()
    at = table_entry(raw, name)[2]
    return int.from_bytes(raw[at:at + 8], "little")


def open_error(path) -> str:
    with pytest.raises(CheckpointError) as e:
        GGUFFiles(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    return str(e.value)


def test_the_unchanged_file_reads(path):
    ckpt = GGUFCheckpoint(GGUFFiles(path))
    assert ckpt.get("model.layers.0.mlp.experts.1.down_proj.weight").shape == (4, 256)


def test_a_larger_type_overlaps_the_next_tensor(path):
    patch(path, GATE_EXPS, "type", Q.Q8_0)  # 272 bytes where Q4_0 took 144
    assert f"GGUF tensor {DOWN_EXPS} (Q4_K [2, 4, 256], at data offset 960) overlaps tensor {GATE_EXPS}" \
        in open_error(path)


def test_a_smaller_type_leaves_a_gap(path):
    patch(path, ATTN_Q, "type", Q.Q4_0)  # 144 bytes (160 aligned) where Q8_0 took 272 (288)
    assert f"GGUF tensor {GATE_EXPS} (Q4_0 [2, 4, 32], at data offset 800) leaves 128 bytes unused after tensor " \
           f"{ATTN_Q}" in open_error(path)


def test_an_offset_moved_onto_a_neighbour(path):
    patch(path, GATE_EXPS, "offset", offset_of(path, ATTN_Q))
    assert f"GGUF tensor {ATTN_Q} (Q8_0 [4, 64], at data offset 512) overlaps tensor {GATE_EXPS}" in open_error(path)


def test_an_unaligned_offset(path):
    patch(path, NORM, "offset", offset_of(path, NORM) + 4)
    assert f"GGUF tensor {NORM} (F32 [32]) starts at data offset 2116, not a multiple of the file's alignment 32" \
        in open_error(path)


def test_a_tensor_past_the_end_of_the_file(path):
    patch(path, NORM, "offset", offset_of(path, NORM) + 64)
    message = open_error(path)
    assert "is truncated or corrupt" in message
    assert f"GGUF tensor {NORM} (F32 [32], 128 bytes at data offset 2176) runs past the end of the file " \
           f"({path.stat().st_size} bytes)" in message


def test_a_row_that_is_not_whole_blocks(path):
    patch(path, GATE_EXPS, "dim0", 48)
    assert f"GGUF tensor {GATE_EXPS} (Q4_0 [2, 4, 48]) is not whole Q4_0 blocks of 32 values per row" \
        in open_error(path)


def test_a_row_longer_than_its_bytes(path):
    patch(path, EMBD, "dim0", 64)
    assert f"GGUF tensor {ATTN_Q} (Q8_0 [4, 64], at data offset 512) overlaps tensor {EMBD}" in open_error(path)


def test_an_unknown_type_names_the_tensor(path):
    patch(path, ATTN_Q, "type", 99)
    assert f"has a tensor of unknown type 99: {ATTN_Q}" in open_error(path)


def test_a_metadata_array_longer_than_the_file(path):
    raw = bytearray(path.read_bytes())
    key = b"tokenizer.ggml.token_type"
    at = raw.index(key) + len(key) + 4 + 4  # value type ARRAY (u32), item type INT32 (u32), then the u64 length
    raw[at:at + 8] = (1 << 56).to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    assert "a metadata array of 72057594037927936 items runs past the end of the file" in open_error(path)


def test_the_unchanged_metadata_makes_a_config(path):
    config = hf_config(GGUFFiles(path))
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_experts"]) == (1, 32, 2)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("embedding_length", "32", r"GGUF metadata qwen3moe.embedding_length must be a number, got '32'"),
    ("attention.head_count_kv", "2", r"GGUF metadata qwen3moe.attention.head_count_kv must be a number"),
    ("block_count", 1 << 30, r"GGUF metadata qwen3moe.block_count is 1073741824, but its tensors hold 1 layers"),
    ("block_count", 0, r"GGUF metadata qwen3moe.block_count is 0, but its tensors hold 1 layers"),
])
def test_a_wrong_metadata_value_names_its_key(tmp_path, key, value, message):
    path = tmp_path / "model.gguf"
    write_small_gguf(path, **{key: value})
    with pytest.raises(CheckpointError, match=message) as e:
        hf_config(GGUFFiles(path))
    assert "\n" not in str(e.value)
