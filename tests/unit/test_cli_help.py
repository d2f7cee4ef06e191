"""--help reads as a user's page: flags in groups, allowed values and defaults in words, GPU-only flags marked,
no Python literals or source paths; every EngineConfig field has its entry in the engine flags' table."""

import argparse
import re
import subprocess
import sys
from dataclasses import fields

import pytest

from hybridmoe.cli import COMMANDS, build_parser
from hybridmoe.commands.engine_args import FLAGS, GROUPS, add_engine_arguments, engine_kwargs
from hybridmoe.config import EngineConfig

ENGINE_COMMANDS = ["run", "chat", "serve", "bench", "doctor", "profile-experts"]
OURS = ["run", "chat", "serve"]
"""Commands whose every flag says its default."""


def subparser(name: str) -> argparse.ArgumentParser:
    return build_parser(name)._subparsers._group_actions[0].choices[name]


def groups(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    return {g.title: g._group_actions for g in parser._action_groups if g._group_actions}


def test_every_engine_config_field_has_exactly_one_table_entry():
    names = [f.name for f in fields(EngineConfig)]
    assert sorted(FLAGS) == sorted(names), "add each EngineConfig field to FLAGS in commands/engine_args.py"
    assert {flag.group for flag in FLAGS.values()} <= set(GROUPS)


def test_a_field_without_an_entry_stops_the_parser_naming_it(monkeypatch):
    monkeypatch.delitem(FLAGS, "cpu_threads")
    with pytest.raises(LookupError, match=r"EngineConfig.cpu_threads has no entry in FLAGS"):
        add_engine_arguments(argparse.ArgumentParser())


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_holds_no_python_literal_or_source_path(name):
    text = subparser(name).format_help()
    found = re.findall(r".*(?:\bNone\b|\bTrue\b|\bFalse\b|EngineConfig|\b\w+\.py\b|weights/|commands/).*", text)
    assert not found


@pytest.mark.parametrize("name", ENGINE_COMMANDS)
def test_engine_flags_sit_in_the_model_engine_and_gpu_groups(name):
    by_group = groups(subparser(name))
    for field_name, flag in FLAGS.items():
        flag_name = "--" + field_name.replace("_", "-")
        assert any(flag_name in a.option_strings for a in by_group[flag.group]), (flag_name, flag.group)


@pytest.mark.parametrize("name, titles", [
    ("run", ["options", "model", "prompt", "sampling", "engine", "GPU"]),
    ("chat", ["options", "model", "chat", "sampling", "engine", "GPU"]),
    ("serve", ["options", "model", "server", "engine", "GPU"]),
])
def test_the_groups_come_in_order_with_model_first(name, titles):
    parser = subparser(name)
    assert list(groups(parser)) == titles
    assert groups(parser)["model"][0].option_strings == ["--model"]


@pytest.mark.parametrize("name", OURS)
def test_every_flag_says_its_default(name):
    for action in subparser(name)._actions:
        if action.help == argparse.SUPPRESS or action.required or "-h" in action.option_strings:
            continue
        assert "(default: " in action.help, action.option_strings


def test_allowed_values_show_as_a_bar_list_and_others_are_refused(capsys):
    text = subparser("run").format_help()
    for shown in ("--device auto|cpu|cuda", "--dtype auto|float32|bfloat16|float16", "--expert-group-size 32|64|128",
                  "--expert-placement uniform|frequency|front-loading", "--cuda-graph, --no-cuda-graph"):
        assert shown in text
    with pytest.raises(SystemExit) as e:
        build_parser("run").parse_args(["run", "--model", "m", "--prompt", "p", "--device", "tpu"])
    assert e.value.code == 2 and "invalid choice: 'tpu'" in capsys.readouterr().err


def test_gpu_flags_are_marked_and_others_are_not():
    for field_name, flag in FLAGS.items():
        action = next(a for a in subparser("run")._actions if a.dest == field_name)
        assert action.help.startswith("(GPU) ") == (flag.group == "GPU"), field_name


def test_help_lines_are_short():
    for field_name, flag in FLAGS.items():
        assert len(flag.help) <= 80 and "\n" not in flag.help, field_name


def test_the_usage_line_names_the_required_flags_then_options():
    assert subparser("run").format_usage().strip() == "usage: hybridmoe run --model PATH --prompt TEXT [options]"
    assert subparser("serve").format_usage().strip() == "usage: hybridmoe serve --model PATH [options]"


def test_engine_flags_given_become_engine_kwargs_and_the_rest_stay_out():
    args = build_parser("run").parse_args(["run", "--model", "m", "--prompt", "p", "--no-cuda-graph",
                                           "--gpu-memory-budget", "16GiB", "--expert-group-size", "32"])
    assert engine_kwargs(args) == {"cuda_graph": False, "gpu_memory_budget": "16GiB", "expert_group_size": 32}


def test_help_of_a_command_does_not_import_torch():
    code = ("import sys\nfrom hybridmoe.cli import main\n"
            "try:\n    main(['run', '--help'])\nexcept SystemExit:\n    pass\n"
            "sys.stderr.write(str('torch' in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "usage: hybridmoe run" in done.stdout and done.stderr == "False"
