"""trainer.logger's tensorboard: event files in <run_dir> (`tensorboard --logdir <log_dir>` plots every run)."""
from __future__ import annotations

from torch.utils.tensorboard import SummaryWriter

from rl_megatron.tracking.backend import BACKENDS, Backend, RunInfo


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """A table as markdown, which tensorboard's text panel renders: numbers to 3 decimals, one line per row."""
    def cell(value) -> str:
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


@BACKENDS.register("tensorboard")
class TensorboardEvents(Backend):
    """Scalars, and tables as text panels. Events of steps after `purge_after` are dropped (the run logs them
    again)."""

    def __init__(self, run: RunInfo):
        self._writer = SummaryWriter(run.run_dir, purge_step=None if run.purge_after is None else run.purge_after + 1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def log_table(self, tag: str, columns: list[str], rows: list[list], step: int) -> None:
        self._writer.add_text(tag, markdown_table(columns, rows), step)

    def close(self, failed: bool) -> None:
        self._writer.close()
