"""Run metrics, written both to metrics.jsonl (easy to parse) and to TensorBoard (easy to plot)."""
from __future__ import annotations

import json
import os

from torch.utils.tensorboard import SummaryWriter


def _step_of(line: str) -> int | None:
    """The step of a metrics.jsonl record; None for a line a killed run left half-written."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


class Tracker:
    """`purge_after`: the step a resumed run continues from. Records of later steps (logged by the interrupted run
    after its checkpoint) are dropped from both outputs; the run logs those steps again. -1 drops every record (a
    run that starts over); None keeps them all."""

    def __init__(self, run_dir: str, purge_after: int | None = None):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        path = os.path.join(run_dir, "metrics.jsonl")
        if purge_after is not None and os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if _step_of(line) is not None and _step_of(line) <= purge_after]
            with open(path, "w") as f:
                f.writelines(kept)
        self._writer = SummaryWriter(run_dir, purge_step=None if purge_after is None else purge_after + 1)
        # Appending lets a resumed run extend the same file.
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        values = {name: float(value) for name, value in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
        # Flushed per line so a crashed or still-running job can be read as is.
        self._jsonl.flush()
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)

    def log_text(self, tag: str, markdown: str, step: int) -> None:
        """A text panel in tensorboard (markdown: tables render)."""
        self._writer.add_text(tag, markdown, step)

    def close(self) -> None:
        self._jsonl.close()
        self._writer.close()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
