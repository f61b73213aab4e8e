"""trainer.logger's jsonl: <run_dir>/metrics.jsonl, one JSON object per record (easy to parse)."""
from __future__ import annotations

import json
import os

from rl_megatron.tracking.backend import BACKENDS, Backend, RunInfo

FILE_NAME = "metrics.jsonl"


def _step_of(line: str) -> int | None:
    """The step of a metrics.jsonl record; None for a line a killed run left half-written."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


@BACKENDS.register("jsonl")
class JsonlLog(Backend):
    """Records of steps after `purge_after` (logged by an interrupted run after its checkpoint) are dropped: the run
    logs those steps again. Tables are not kept: the file holds numbers."""

    def __init__(self, run: RunInfo):
        path = os.path.join(run.run_dir, FILE_NAME)
        if run.purge_after is not None and os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if _step_of(line) is not None and _step_of(line) <= run.purge_after]
            with open(path, "w") as f:
                f.writelines(kept)
        # Appending lets a resumed run extend the same file.
        self._file = open(path, "a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        # Flushed per line so a crashed or still-running job can be read as is.
        self._file.flush()

    def log_table(self, tag: str, columns: list[str], rows: list[list], step: int) -> None:
        pass

    def close(self, failed: bool) -> None:
        self._file.close()
