"""`hybridmoe finetune`: LoRA training through the CLI on a tiny make-model checkpoint (Qwen3-MoE, float32, ChatML
template) and a 20-line chat JSONL: it trains, writes an adapter peft loads, checkpoints, resumes where it stopped
(the resumed run's steps and adapter equal an uninterrupted run's), labels the assistant's tokens only, and names
the line of bad input in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from tiny_families import tiny_model

from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.cli import main
from hybridmoe.errors import HybridMoEError
from hybridmoe.hf.chat_data import IGNORE, ChatDataError, Example, load_chat_data
from hybridmoe.hf.finetune import FinetuneOptions, data_summary
from hybridmoe.hf.lora_targets import lora_target_modules
from hybridmoe.hf.training import TrainPlan, micro_batches

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

QA = [("What is the capital of France?", "The capital of France is Paris."),
      ("Hello!", "Hello! How are you today?"),
      ("Tell me a joke.", "Why did the scarecrow win an award? Because he was outstanding in his field."),
      ("Write a short poem about the sea.", "The sea is wide and deep and blue."),
      ("Can you help me with my homework?", "Of course, I would be happy to help.")]
KNOWN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"},
         {"role": "assistant", "content": "Hi there."}, {"role": "user", "content": "Capital of France?"},
         {"role": "assistant", "content": "Paris."}]
LAST_TURN_THINKS = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{{- m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
"""Qwen3's way: only a final assistant turn gets its (empty) reasoning block, so the conversation through an earlier
turn renders unlike the whole conversation's start."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    make_checkpoint("qwen3_moe", "tiny", path, dtype="fp32", progress=False)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """20 conversations, every third with a second exchange, every other with a system message."""
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    lines = []
    for i in range(20):
        question, answer = QA[i % len(QA)]
        messages = [{"role": "system", "content": "You are a helpful assistant."}] if i % 2 else []
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": "Thank you."}, {"role": "assistant", "content": "You are welcome."}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def finetune(checkpoint, data, out, *options: str) -> int:
    return main(["finetune", "--model", str(checkpoint), "--data", str(data), "--out", str(out), "--cpu-threads", "1",
                 "--batch-size", "2", "--grad-accum", "2", "--lr", "1e-2", *options])


def logged_losses(out) -> dict[int, float]:
    lines = (out / "train_log.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def test_it_trains_checkpoints_and_resumes_as_an_uninterrupted_run(checkpoint, data, tmp_path, capsys):
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert finetune(checkpoint, data, whole, "--max-steps", "4", "--save-every", "2") == 0
    assert "wrote the LoRA adapter to" in capsys.readouterr().err
    assert sorted(p.name for p in whole.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert finetune(checkpoint, data, split, "--max-steps", "2", "--save-every", "2") == 0
    assert finetune(checkpoint, data, split, "--max-steps", "4", "--save-every", "2", "--resume") == 0
    capsys.readouterr()
    assert finetune(checkpoint, data, split, "--max-steps", "6", "--resume", "--seed", "1") == 2
    assert "checkpoint-4 comes from a run with seed 0 (now 1); resume with the same" in capsys.readouterr().err
    want, got = logged_losses(whole), logged_losses(split)
    assert sorted(got) == [1, 2, 3, 4]
    assert got == pytest.approx(want, rel=1e-6)
    assert want[4] < want[1]
    want_adapter = load_file(whole / "adapter_model.safetensors")
    got_adapter = load_file(split / "adapter_model.safetensors")
    assert want_adapter.keys() == got_adapter.keys()
    for name, tensor in want_adapter.items():
        torch.testing.assert_close(got_adapter[name], tensor, rtol=1e-6, atol=0)


def test_the_adapter_is_one_peft_loads(checkpoint, data, tmp_path, capsys):
    import hybridmoe.hf

    out = tmp_path / "adapter"
    assert finetune(checkpoint, data, out, "--max-steps", "2", "--lora-rank", "4", "--lora-alpha", "8") == 0
    capsys.readouterr()
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    saved = load_file(out / "adapter_model.safetensors")
    model = hybridmoe.hf.from_pretrained(checkpoint, cpu_threads=1)
    prompt = torch.tensor([[1, 20, 30, 40]])
    with torch.no_grad():
        base_logits = model(prompt).logits
        loaded = peft.PeftModel.from_pretrained(model, out)
        adapted_logits = loaded(prompt).logits
    weights = peft.utils.get_peft_model_state_dict(loaded)
    assert weights.keys() == saved.keys() and len(saved) == 2 * 4 * 2  # A and B of 4 projections in 2 layers
    for name, tensor in saved.items():
        assert torch.equal(weights[name], tensor)
    assert any("lora_B" in name and tensor.norm() > 0 for name, tensor in saved.items())  # trained
    assert not torch.allclose(adapted_logits, base_logits)


def assistant_text(tokenizer, example) -> list[str]:
    """The labelled tokens of example, each run of consecutive ones decoded."""
    runs, current = [], []
    for token, label in zip(example.input_ids, example.labels):
        if label != IGNORE:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


def test_the_loss_covers_the_assistants_turns_and_their_end_markers_only(checkpoint, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    path = tmp_path / "known.jsonl"
    path.write_text(json.dumps({"messages": KNOWN}) + "\n")
    example = load_chat_data(path, tokenizer, 512).examples[0]
    assert assistant_text(tokenizer, example) == ["Hi there.<|im_end|>", "Paris.<|im_end|>"]
    rendered = tokenizer.apply_chat_template(KNOWN, tokenize=False)
    assert example.input_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    tokenizer.chat_template = LAST_TURN_THINKS
    example = load_chat_data(path, tokenizer, 512).examples[0]
    assert assistant_text(tokenizer, example) == ["Hi there.<|im_end|>", "<think>\n\n</think>\n\nParis.<|im_end|>"]


def write_lines(path, *lines: str):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_bad_input_names_its_line(checkpoint, tmp_path, capsys):
    good = json.dumps({"messages": KNOWN})
    no_assistant = json.dumps({"messages": [{"role": "user", "content": "Hi"}]})
    cases = [(tmp_path / "missing.jsonl", "missing.jsonl: no such file"),
             (write_lines(tmp_path / "a.jsonl", good, "", '{"messages": [oops'), "a.jsonl line 3 is not JSON"),
             (write_lines(tmp_path / "b.jsonl", good, no_assistant), "b.jsonl line 2 has no assistant message"),
             (write_lines(tmp_path / "c.jsonl", '{"text": "hi"}'),
              'c.jsonl line 1: expected an object with a non-empty "messages" list'),
             (write_lines(tmp_path / "d.jsonl", good, good),
              "d.jsonl has no conversation to train on: all 2 are longer than --max-length 8 tokens")]
    for data, message in cases:
        assert finetune(checkpoint, data, tmp_path / "out", "--max-length", "8") == 2
        err = capsys.readouterr().err
        assert err.startswith("hybridmoe finetune: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_longer_conversations_are_skipped_and_their_lines_named(checkpoint, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    long = json.dumps({"messages": [{"role": "user", "content": "tell me " * 100}, KNOWN[2]]})
    path = write_lines(tmp_path / "mixed.jsonl", json.dumps({"messages": KNOWN}), long, "", long)
    data = load_chat_data(path, tokenizer, 64)
    assert data.too_long == [2, 4] and [e.line for e in data.examples] == [1]
    summary = data_summary(data, FinetuneOptions(checkpoint, path, tmp_path / "out", max_length=64))
    assert summary.endswith("; skipped 2 longer than --max-length 64 tokens (lines 2, 4)")
    tokenizer.chat_template = "{{ raise_exception('this template renders nothing') }}"
    with pytest.raises(ChatDataError, match=r"mixed.jsonl line 1: the chat template cannot render this conversation "
                                            r"\(TemplateError: this template renders nothing\)$"):
        load_chat_data(path, tokenizer, 64)


def test_the_output_directory_must_be_new_or_resumed(checkpoint, data, tmp_path, capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    assert finetune(checkpoint, data, tmp_path / "used") == 2
    assert "is not empty; pick a new directory, or pass --resume" in capsys.readouterr().err
    assert finetune(checkpoint, data, tmp_path / "used", "--resume") == 2
    assert "holds no checkpoint-STEP directory to resume from" in capsys.readouterr().err


def test_lora_targets_name_the_layers_or_say_what_the_model_has():
    qwen2 = tiny_model("qwen2_moe")
    assert lora_target_modules("attention+mlp", qwen2) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]
    assert lora_target_modules("attention", tiny_model("deepseek_v3")) == ["q_a_proj", "q_b_proj",
                                                                         "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    assert lora_target_modules("q_proj, v_proj", qwen2) == ["q_proj", "v_proj"]
    with pytest.raises(HybridMoEError, match="MixtralForCausalLM has no shared experts or dense MLP layers"):
        lora_target_modules("attention+mlp", tiny_model("mixtral"))
    with pytest.raises(HybridMoEError, match=r"--lora-targets 'q_proj,experts': experts is no linear layer"):
        lora_target_modules("q_proj,experts", qwen2)


def test_without_peft_it_says_what_to_install_in_one_line(tmp_path):
    code = ("import sys\n"
            "sys.modules['peft'] = None  # an install without the finetune extra\n"
            "from hybridmoe.cli import main\n"
            f"sys.exit(main(['finetune', '--model', 'm', '--data', 'd.jsonl', '--out', {str(tmp_path)!r}]))\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == "hybridmoe finetune needs transformers and peft: pip install 'hybridmoe[finetune]'\n"


def test_each_epoch_reads_every_conversation_once_in_its_own_order():
    examples = [Example([1, 2], [IGNORE, 2], line) for line in range(1, 6)]
    plan = TrainPlan(epochs=3, batch_size=2, grad_accum=2)
    assert plan.total_micro_batches(5) == 9 and plan.total_steps(5) == 5  # 3 batches an epoch, the last step 1
    stream = micro_batches(examples, plan)
    epochs = [[[e.line for e in next(stream)] for _ in range(3)] for _ in range(3)]
    for epoch in epochs:
        assert [len(batch) for batch in epoch] == [2, 2, 1]
        assert sorted(line for batch in epoch for line in batch) == [1, 2, 3, 4, 5]
    assert len({str(epoch) for epoch in epochs}) == 3
    assert TrainPlan(max_steps=7, grad_accum=3).total_steps(5) == 7


def test_an_adapter_trained_here_runs_in_the_engine_as_peft_runs_it(checkpoint, data, tmp_path, capsys):
    """The finetune -> --lora round trip: the engine's own forward with the adapter merged at load gives the logits
    of transformers' model with peft's adapter over it, and `run --lora` decodes other text than the base model."""
    from hybridmoe import LLM
    from hybridmoe.forward_context import single_sequence_context, use_context

    out = tmp_path / "adapter"
    assert finetune(checkpoint, data, out, "--max-steps", "3", "--lora-rank", "4", "--lora-alpha", "8") == 0
    prompt = [1, 20, 30, 40, 7, 9]
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(base, out)(torch.tensor([prompt])).logits[0]

    def engine_logits(**lora) -> torch.Tensor:
        model = LLM(str(checkpoint), dtype="float32", expert_backend="torch", device="cpu", **lora).engine.runner.model
        model.allocate_kv_cache(1, 64)
        with torch.no_grad(), use_context(single_sequence_context(len(prompt))):
            return model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))

    torch.testing.assert_close(engine_logits(lora=str(out)), want, atol=1e-4, rtol=1e-4)
    assert (engine_logits() - want).abs().max() > 1e-3  # the merged adapter is what makes them agree
    capsys.readouterr()
    texts = []
    for extra in ([], ["--lora", str(out)]):
        assert main(["run", "--model", str(checkpoint), "--prompt", "Hello", "--max-new-tokens", "8",
                     "--temperature", "0", "--dtype", "float32", *extra]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] != texts[1]
