import io

import pytest

from hybridmoe import LLM, SamplingParams
from hybridmoe.cli import main
from hybridmoe.commands.chat import ChatSession

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
    assert capsys.readouterr().out.endswith(" [stopped]\n")
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
