import subprocess
import sys
from importlib.metadata import version

import pytest

from hybridmoe.cli import main
from hybridmoe.platform import native_engine_built


def test_version_names_the_package_torch_and_the_native_engine(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first == f"hybridmoe {version('hybridmoe')}"
    engine = "built" if native_engine_built() else "not built"
    assert second.startswith(f"torch {version('torch')}, native expert engine {engine}")


def test_version_answers_from_the_command_line():
    done = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("hybridmoe ") and done.stderr == ""


def test_a_command_is_still_required_without_version(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2 and "the following arguments are required: COMMAND" in capsys.readouterr().err
