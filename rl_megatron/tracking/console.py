"""trainer.logger's console: the steps on the terminal, as a tqdm progress bar (trainer.progress_bar=true) or one
line per step; and `write`, the trainer's way to print a line without breaking the bar."""
from __future__ import annotations

import sys

from tqdm import tqdm


def write(line: str) -> None:
    """`line` on stdout, above the progress bar if one is shown (a plain print would tear it)."""
    tqdm.write(line)
    sys.stdout.flush()  # a batch job's log shows it at once


class Console:
    """Each step's reward/mean, the mean reward of the last 5 steps (the trainer's window) and timing_s/step."""

    def __init__(self, progress_bar: bool, title: str, total_steps: int):
        self.progress_bar, self.title, self.total_steps = progress_bar, title, total_steps
        self._bar: tqdm | None = None

    def start(self, initial_step: int) -> None:
        """The steps begin after `initial_step` (a resumed run's checkpoint; 0)."""
        if self.progress_bar:
            self._bar = tqdm(desc=self.title, unit="step", initial=initial_step, total=self.total_steps)

    def show_step(self, step: int, metrics: dict[str, float], reward_window_mean: float) -> None:
        reward, seconds = metrics["reward/mean"], metrics["timing_s/step"]
        if self._bar is None:
            write(f"step {step}/{self.total_steps}: reward={reward:.3f}, avg5={reward_window_mean:.3f}, "
                  f"step_s={seconds:.2f}")
            return
        self._bar.set_postfix(reward=f"{reward:.3f}", avg5=f"{reward_window_mean:.3f}", step_s=f"{seconds:.2f}",
                              refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
