"""A tokenizer written into GGUF metadata (tokens, merges, token types, ids, chat template) comes back
encoding, decoding and templating exactly as the original tokenizer.json does."""

import gguf
import numpy as np
import pytest
from gguf_writer import tokenizer_metadata

from hybridmoe.checkpoint.tokenizer import write_tokenizer
from hybridmoe.tokenizer import Tokenizer
from hybridmoe.weights.gguf_file import GGUFFiles
from hybridmoe.weights.gguf_tokenizer import tokenizer_files

TEXTS = ["The capital of France is Paris.", "  two spaces, tabs\tand\nnewlines  ", "Zürich → 東京 🚀",
         "<|im_start|>user\nhi<|im_end|>", "<｜User｜>hello<｜Assistant｜>", "[INST] joke [/INST]", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_gguf_tokenizer_round_trip(tmp_path, family):
    write_tokenizer(tmp_path, family, 1000)
    original = Tokenizer.from_dir(tmp_path)
    w = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "qwen3moe")
    tokenizer_metadata(w, tmp_path)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok, config = tokenizer_files(GGUFFiles(tmp_path / "tok.gguf").metadata)
    rebuilt = Tokenizer(tok, config, config.get("chat_template"))
    assert rebuilt.vocab_size == original.vocab_size
    assert rebuilt.special_tokens == original.special_tokens
    for text in TEXTS:
        ids = original.encode(text)
        assert rebuilt.encode(text) == ids, text
        assert rebuilt.decode(ids) == original.decode(ids)
        assert rebuilt.decode(ids, skip_special_tokens=False) == original.decode(ids, skip_special_tokens=False)
    assert rebuilt.encode_chat(MESSAGES) == original.encode_chat(MESSAGES)
