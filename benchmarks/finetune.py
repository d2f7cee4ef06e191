"""LoRA fine-tuning (issue #31): tokens/s and peak GPU and CPU memory of hybridmoe's training against accelerate's
expert offload and the all-GPU model, on the same synthetic checkpoint and tokens.

    python3 benchmarks/finetune.py sft [options]     (python3 benchmarks/finetune.py sft --help)
"""

from __future__ import annotations

import sys

if __package__:
    from .lib import finetune_bench
    from .lib.cli import main as run_command
else:
    from lib import finetune_bench
    from lib.cli import main as run_command

COMMANDS = {"sft": finetune_bench}


def main(argv: list[str] | None = None) -> int:
    return run_command("finetune.py", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
