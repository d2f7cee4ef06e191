import io
import re
from types import SimpleNamespace

import pytest

from hybridmoe import LLM, SamplingParams
from hybridmoe.cli import main
from hybridmoe.commands.chat import ChatSession, empty_reason

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen3_fp32):
    return LLM(tiny_qwen3_fp32)


def test_each_turn_sees_the_whole_history(llm, capsys):
    session = ChatSession(llm, GREEDY, system="Be brief.")
    session.say("Hello!")
    session.say("What is the capital of France?")
    assert [m["role"] for m in session.history] == ["system", "user", "assistant", "user", "assistant"]
    first, second = session.history[2]["content"], session.history[4]["content"]
    assert capsys.readouterr().out == first + "\n" + second + "\n"
    assert second == llm.chat(session.history[:4], GREEDY)[0].text


def test_clear_forgets_the_conversation(llm, capsys):
    session = ChatSession(llm, GREEDY)
    session.say("Hello!")
    session.clear()
    session.say("Hi")
    assert session.history[0] == {"role": "user", "content": "Hi"} and len(session.history) == 2


def test_ctrl_c_stops_the_reply_and_the_session_goes_on(llm, capsys, monkeypatch):
    engine = llm.engine
    real_step, calls = engine.step, []

    def step_interrupted_on_the_third_call():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step_interrupted_on_the_third_call)
    session = ChatSession(llm, GREEDY)
    session.say("Hello!")
    out, err = capsys.readouterr()
    assert out.endswith(" [stopped]\n") and "tokens, stopped; first token" in err
    assert not engine.has_unfinished() and len(engine.scheduler.free_slots) == engine.config.max_num_seqs
    session.say("Are you there?")
    assert len(session.history) == 4 and "[stopped]" not in capsys.readouterr().out


def test_the_command_reads_turns_until_exit(tiny_qwen3_fp32, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello!\n/clear\n/what\n\nHi\n/exit\nnever read\n"))
    assert main(["chat", "--model", str(tiny_qwen3_fp32), "--max-new-tokens", "4", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.count(">>> ") == 6 and "(conversation cleared)" in err and "unknown command /what" in err


def test_the_command_prints_the_engine_choices_to_stderr(tiny_qwen3_fp32, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("/exit\n"))
    assert main(["chat", "--model", str(tiny_qwen3_fp32), "--expert-backend", "torch"]) == 0
    out, err = capsys.readouterr()
    assert "choices:" not in out
    line = err.splitlines()[0]  # the same line as bench's, before the help line
    assert line.startswith("choices:    device cpu, expert_backend torch, gpu_memory_budget none")
    assert line.endswith("cuda_graph off")


def test_end_of_input_ends_the_session(tiny_qwen3_fp32, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello!\n"))
    assert main(["chat", "--model", str(tiny_qwen3_fp32), "--max-new-tokens", "4"]) == 0


def test_a_model_without_chat_template_is_a_clear_error(tiny_qwen3_fp32, tmp_path, capsys):
    for f in tiny_qwen3_fp32.iterdir():
        if not f.name.startswith("tokenizer"):
            (tmp_path / f.name).symlink_to(f)
    assert main(["chat", "--model", str(tmp_path)]) == 2
    assert "has no chat template" in capsys.readouterr().err


STATS = re.compile(r"^\[(\d+) tokens, (\w+); first token \d+ ms, [\d.]+ tok/s after\]$", re.MULTILINE)


def test_each_reply_is_followed_by_its_tokens_and_speed_on_stderr(tiny_qwen3_fp32, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello!\nHi\n"))
    assert main(["chat", "--model", str(tiny_qwen3_fp32), "--max-new-tokens", "4", "--temperature", "0",
                 "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert STATS.findall(err) == [("4", "length"), ("4", "length")] and "tok/s" not in out


def test_without_max_new_tokens_a_reply_runs_to_the_end_of_the_context(tiny_qwen3_fp32, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    assert main(["chat", "--model", str(tiny_qwen3_fp32), "--max-model-len", "48", "--temperature", "0",
                 "--ignore-eos"]) == 0
    prompt_len = len(LLM(tiny_qwen3_fp32).encode_chat([{"role": "user", "content": "Hi"}]))
    assert STATS.findall(capsys.readouterr().err) == [(str(48 - prompt_len), "length")]


def test_a_reply_that_stops_at_once_says_why(llm, capsys):
    first = llm.chat([{"role": "user", "content": "Hello!"}], GREEDY)[0].token_ids[0]
    session = ChatSession(llm, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[first]))
    session.say("Hello!")
    out, err = capsys.readouterr()
    assert out == "\n" and session.history[-1] == {"role": "assistant", "content": ""}
    assert STATS.findall(err) == [("1", "stop")]
    assert "(empty reply: the model produced a stop token at once)" in err


def test_a_conversation_that_fills_the_context_is_refused_and_left_out(tiny_qwen3_fp32, capsys):
    session = ChatSession(LLM(tiny_qwen3_fp32, max_model_len=16), GREEDY)
    session.say("a long message " * 8)
    out, err = capsys.readouterr()
    assert session.history == [] and out == "" and "the conversation fills the context" in err


@pytest.mark.parametrize("finish, tokens, max_tokens, why", [
    ("stop", 1, 10, "the model produced a stop token at once"),
    ("stop", 3, 10, "its 3 tokens end in a stop string or are special tokens"),
    ("length", 6, 6, "the context is full (16 tokens)"),
    ("length", 2, 2, "its 2 tokens (--max-new-tokens 2) decode to no visible text"),
])
def test_an_empty_reply_names_its_cause(finish, tokens, max_tokens, why):
    out = SimpleNamespace(finish_reason=finish, token_ids=[0] * tokens)
    assert empty_reason(out, max_tokens, prompt_len=10, max_model_len=16).startswith(why)
