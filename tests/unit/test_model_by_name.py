"""--model by Hugging Face repo id: org/name (at a --revision) and org/name:QUANT for a GGUF repo, resolved from a
Hub cache the test lays out as huggingface_hub does (models--org--name/{blobs,snapshots/<commit>,refs/<ref>}),
offline; a local path of the same spelling wins; a name nowhere to be found is a one-line error saying what was
tried; a model loaded by name generates the tokens of the same directory loaded by path."""

from pathlib import Path

import pytest
from hub_cache import directory_files, put, use_offline_cache

from hybridmoe import LLM, SamplingParams
from hybridmoe.cli import main
from hybridmoe.config import EngineConfig
from hybridmoe.errors import CheckpointError, HybridMoEError
from hybridmoe.weights.gguf_model_dir import resolve_model_path
from hybridmoe.weights.hub import parse_hub_ref, pick_gguf, resolve_model_source

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
SAFETENSORS_FILES = {"config.json": b"{}", "tokenizer.json": b"{}", "model.safetensors": b"weights"}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hub cache, offline, and a working directory of the test's own (where relative paths point)."""
    cache = use_offline_cache(tmp_path / "hub", monkeypatch)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return cache


def test_a_repo_id_resolves_to_its_cached_snapshot_offline(hub):
    snapshot = put(hub, "org/tiny", SAFETENSORS_FILES, COMMIT_A)
    assert resolve_model_source("org/tiny") == snapshot
    assert resolve_model_path("org/tiny", EngineConfig()) == snapshot


def test_revision_picks_a_ref_or_a_commit(hub):
    main_snapshot = put(hub, "org/tiny", SAFETENSORS_FILES, COMMIT_A)
    v1_snapshot = put(hub, "org/tiny", {**SAFETENSORS_FILES, "config.json": b'{"v": 1}'}, COMMIT_B, refs=("v1",))
    assert resolve_model_source("org/tiny", "v1") == v1_snapshot
    assert resolve_model_source("org/tiny", COMMIT_B) == v1_snapshot
    assert resolve_model_source("org/tiny", COMMIT_A) == main_snapshot
    assert resolve_model_path("org/tiny", EngineConfig(revision="v1")) == v1_snapshot


def test_a_local_path_wins_over_the_repo_id_it_spells(hub):
    put(hub, "org/tiny", SAFETENSORS_FILES, COMMIT_A)
    local = Path("org/tiny")
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    assert resolve_model_source("org/tiny") == local
    assert resolve_model_path("org/tiny", EngineConfig(revision="v1")) == local  # a local path ignores revision


def test_a_repo_missing_offline_is_one_line_saying_what_was_tried(hub):
    with pytest.raises(CheckpointError) as e:
        resolve_model_path("org/missing", EngineConfig(revision="v2"))
    message = str(e.value)
    assert "\n" not in message
    for part in (f"no file or directory at {Path.cwd() / 'org/missing'}", "repo org/missing", "revision v2",
                 "offline (HF_HUB_OFFLINE=1)", f"cache {hub}", "not in the cache"):
        assert part in message, part


def test_a_cached_snapshot_without_its_weights_says_what_it_lacks(hub):
    index = b'{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    put(hub, "org/tiny", {"config.json": b"{}", "model.safetensors.index.json": index,
                          "model-00001-of-00002.safetensors": b"w"}, COMMIT_A)
    with pytest.raises(CheckpointError, match=r"lacks model-00002-of-00002\.safetensors$"):
        resolve_model_source("org/tiny")


GGUF_NAMES = ["Tiny-Q4_K_M-00001-of-00003.gguf", "Tiny-Q4_K_M-00002-of-00003.gguf", "Tiny-Q4_K_M-00003-of-00003.gguf",
              "Tiny-Q4_K_S.gguf", "Tiny-Q8_0.gguf", "Tiny-Q4_0.gguf", "Tiny-Q4_0_4_4.gguf", "mmproj-Q8_0.gguf",
              "README.md"]


def test_a_gguf_repo_with_a_quant_tag_resolves_to_its_files(hub):
    snapshot = put(hub, "org/tiny-GGUF", {n: n.encode() for n in GGUF_NAMES}, COMMIT_A)
    assert resolve_model_source("org/tiny-GGUF:q4_k_m") == snapshot / "Tiny-Q4_K_M-00001-of-00003.gguf"
    assert resolve_model_source("org/tiny-GGUF:Q8_0") == snapshot / "Tiny-Q8_0.gguf"  # not the mmproj file
    assert resolve_model_source("org/tiny-GGUF:Q4_0") == snapshot / "Tiny-Q4_0.gguf"  # the whole tag wins


def test_pick_gguf_takes_a_split_model_whole():
    names = ["Q4_K_M/Big-Q4_K_M-00002-of-00002.gguf", "Q4_K_M/Big-Q4_K_M-00001-of-00002.gguf", "Big-Q8_0.gguf"]
    assert pick_gguf(names, "Q4_K_M") == sorted(names[:2])
    with pytest.raises(LookupError, match=r"'Q4_K' matches 2 models \(.*Q4_K_M-\*-of-00003\.gguf, Tiny-Q4_K_S"):
        pick_gguf(GGUF_NAMES, "Q4_K")
    with pytest.raises(LookupError, match=r"no \.gguf file has 'IQ2_XS' in its name \(its \.gguf files: Tiny-Q4_0"):
        pick_gguf(GGUF_NAMES, "IQ2_XS")


def test_gguf_mistakes_name_the_files_offline(hub):
    put(hub, "org/tiny-GGUF", {n: n.encode() for n in GGUF_NAMES[1:]}, COMMIT_A)  # the split lacks its part 1
    with pytest.raises(CheckpointError, match=r"\.gguf files matching 'Q4_K_M'.*has 2 of its 3 parts$"):
        resolve_model_source("org/tiny-GGUF:Q4_K_M")
    with pytest.raises(CheckpointError, match=r"no config\.json, only \.gguf files .*name one as org/name:QUANT"):
        resolve_model_source("org/tiny-GGUF")


def test_what_is_a_repo_id():
    assert parse_hub_ref("org/name") is not None and parse_hub_ref("org/name:Q4_K_M").quant == "Q4_K_M"
    for path in ("name", "./org/name", "../org/name", "/org/name", "org/name/sub", "org/name.gguf", "org/name:"):
        assert parse_hub_ref(path) is None, path


def test_revision_is_checked():
    assert EngineConfig(revision="refs/pr/1").revision == "refs/pr/1"
    with pytest.raises(HybridMoEError, match="revision must be a branch, tag or commit hash"):
        EngineConfig(revision="v 1")


def test_a_model_by_name_generates_what_its_directory_does(hub, tiny_qwen3_fp32):
    put(hub, "org/tiny", directory_files(tiny_qwen3_fp32), COMMIT_A)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    by_name = LLM("org/tiny").generate([1, 2, 3, 4], params)[0].token_ids
    by_path = LLM(tiny_qwen3_fp32).generate([1, 2, 3, 4], params)[0].token_ids
    assert len(by_name) == 8 and by_name == by_path


def test_run_takes_a_repo_id_and_revision(hub, tiny_qwen3_fp32, capsys):
    put(hub, "org/tiny", directory_files(tiny_qwen3_fp32), COMMIT_B, refs=("v1",))
    argv = ["--prompt", "Once upon a time", "--max-new-tokens", "6", "--temperature", "0", "--ignore-eos"]
    assert main(["run", "--model", "org/tiny", "--revision", "v1", *argv]) == 0
    by_name = capsys.readouterr().out
    assert main(["run", "--model", str(tiny_qwen3_fp32), *argv]) == 0
    assert by_name == capsys.readouterr().out
    assert main(["run", "--model", "org/tiny", *argv]) == 2  # no main ref in this cache
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "repo org/tiny (revision main; offline" in err


def test_a_hub_out_of_reach_online_is_one_line(hub, monkeypatch):
    import socket

    import huggingface_hub.constants as constants

    with socket.socket() as s:  # a port nothing listens on: the Hub's requests are refused at once, on this host
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    for model, tried in (("org/missing", "revision main; online"),
                         ("org/missing:Q4_K_M", "revision main, .gguf files matching 'Q4_K_M'; online")):
        with pytest.raises(CheckpointError) as e:
            resolve_model_source(model)
        assert "\n" not in str(e.value) and tried in str(e.value) and "the download failed: " in str(e.value)
