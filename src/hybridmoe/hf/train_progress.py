"""Progress of a training run: a tqdm bar with each step's loss and tokens/s where tqdm is installed, else one plain
line a step through `show`; nothing where show is None."""

from __future__ import annotations

from collections.abc import Callable


class Progress:
    """Steps `done`..`total` of a run; update() after each step, close() at the end."""

    def __init__(self, total: int, done: int, show: Callable[[str], None] | None = print):
        self.total = total
        self.show = show
        self.bar = None
        if show is not None:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, initial=done, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float, tokens_per_second: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_second:.0f} tok/s", refresh=False)
            self.bar.update(1)
        elif self.show is not None:
            self.show(f"step {step}/{self.total}: loss {loss:.4f}, {tokens_per_second:.0f} tok/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
