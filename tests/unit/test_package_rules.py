"""The package's import rules (docs/architecture.md) hold, checked from the source by scripts/check_layering.py;
and the checker itself finds each kind of violation in a small package written here."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_layering.py"


def check(package: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(package)], capture_output=True, text=True, timeout=120)


def test_the_package_keeps_its_import_rules():
    done = check(ROOT / "src" / "hybridmoe")
    assert done.returncode == 0, done.stdout


def write_package(root: Path, files: dict[str, str]) -> Path:
    package = root / "hybridmoe"
    for name, text in {"__init__.py": "", **files}.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    return package


def test_a_clean_package_passes(tmp_path):
    package = write_package(tmp_path, {
        "errors.py": "class E(Exception): pass\n",
        "layers/norm.py": "from hybridmoe.errors import E\n",
        "experts/base.py": "from hybridmoe.layers.norm import E\n",
        "models/qwen.py": "from hybridmoe.experts.base import E\n",
        "layers/fast.py": "import triton\n",
        "layers/attn.py": "def f():\n    from hybridmoe.layers.fast import g\n",
        "weights/gguf_file.py": "import gguf\n",
        "weights/gguf_checkpoint.py": "from hybridmoe.weights.gguf_file import x\n",
        "weights/open.py": "def f():\n    from hybridmoe.weights.gguf_checkpoint import y\n",
        "commands/run.py": "def main():\n    from hybridmoe.models.qwen import E\n",
    })
    done = check(package)
    assert done.returncode == 0, done.stdout


def test_loading_the_engine_imports_neither_gguf_nor_triton_kernels():
    """A load of a Hugging Face directory never needs the gguf package, and the CPU path no Triton kernel."""
    code = ("import sys, hybridmoe.engine.llm_engine, hybridmoe.server.app, hybridmoe.commands.run\n"
            "print(sorted(m for m in sys.modules if m == 'gguf' or m.endswith('_triton')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_forbidden_direction_is_named(tmp_path):
    package = write_package(tmp_path, {"layers/moe.py": "from hybridmoe.experts.base import X\n",
                                       "experts/base.py": "X = 1\n"})
    done = check(package)
    assert done.returncode == 1 and "layers/ must not import experts/" in done.stdout


def test_a_function_level_import_counts(tmp_path):
    package = write_package(tmp_path, {"weights/loader.py": "def load():\n    from hybridmoe.engine.run import go\n",
                                       "engine/run.py": "def go(): pass\n"})
    done = check(package)
    assert "weights/ must not import engine/" in done.stdout
    assert "imports hybridmoe.engine.run inside a function" in done.stdout


def test_a_circle_between_parts_is_found(tmp_path):
    package = write_package(tmp_path, {"alpha/a.py": "from hybridmoe.beta.b import y\nx = 1\n",
                                       "beta/b.py": "def f():\n    from hybridmoe.alpha.a import x\ny = 2\n"})
    done = check(package)
    assert done.returncode == 1 and "import circle between parts: alpha -> beta -> alpha" in done.stdout


def test_a_neutral_module_may_not_reach_up(tmp_path):
    package = write_package(tmp_path, {"config.py": "from hybridmoe.engine.run import go\n",
                                       "engine/run.py": "def go(): pass\n"})
    done = check(package)
    assert "the neutral module hybridmoe.config imports hybridmoe.engine.run" in done.stdout
