"""A scorer process of `RewardScorer`: `python -m rl_megatron.rewards.worker CONN_FD PROGRESS_FD CODE_JSON`.

It receives chunks of samples over the connection on CONN_FD and answers each chunk with one message (not one
per sample, to keep the overhead of cheap scorers small). So that the controller can still time every sample
on its own, the process writes the index of the sample it is scoring and when it started into two doubles
of the shared memory on PROGRESS_FD; the controller kills the process when a sample runs past the timeout.

A fresh interpreter (not a fork of the controller, nor multiprocessing's spawn, which re-imports the
trainer's main module and torch with it) keeps the process small, fast to start and free of the
controller's threads and locks.
"""
from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

from rl_megatron.plugins import import_user_modules
from rl_megatron.rewards import SCORERS, score
from rl_megatron.rewards.custom import load_custom_fn

PROGRESS_BYTES = 16
IDLE = 0.0  # the progress start time while no sample is being scored
ERROR_CHARS = 500  # an error message is cut to this length: it only goes into a warning


@dataclass
class ScorerCode:
    """What a scorer process loads and how it calls the scorers: reward.custom_fn, the modules of trainer.imports
    (whose @register calls add scorers), and the keyword arguments each data source's scorer takes from the reward
    config ({data_source: {keyword: value}}, e.g. gsm8k's match=reward.gsm8k_match)."""
    custom_fn: str | None
    imports: list[str]
    keywords: dict[str, dict]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ScorerCode:
        return cls(**json.loads(text))


def progress_view(fd: int):
    """Two shared doubles over the memory file `fd`: [index in the chunk, time.monotonic() it started]."""
    return (ctypes.c_double * 2).from_buffer(mmap.mmap(fd, PROGRESS_BYTES))


def finite_float(value, what: str, poisons: str) -> float:
    """`value` (a number, numpy scalars too, or a bool) as a finite float; `what` and `poisons` name it in the error."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"the scorer returned {what}{type(value).__name__} {str(value)[:80]!r}, not a "
                        "number") from None
    if not math.isfinite(number):
        raise ValueError(f"the scorer returned {what}{number}, which would poison {poisons}")
    return number


def as_reward(raw) -> tuple[float, float]:
    """(score, acc) of a scorer's return value: a number, a bool, or a verl-style dict {"score": ..., "acc": ...}
    whose "acc" (DAPO logs it beside the shaped score and filters groups on it) is optional; acc defaults to
    the score."""
    if not isinstance(raw, dict):
        score = finite_float(raw, "", "the advantages")
        return score, score
    if "score" not in raw:
        raise TypeError(f"the scorer returned a dict without a 'score' entry (keys: {sorted(map(str, raw))[:8]})")
    score = finite_float(raw["score"], "", "the advantages")
    return score, finite_float(raw["acc"], "an 'acc' of ", "the accuracy") if "acc" in raw else score


def score_chunk(samples: list, custom_fn, keywords: dict[str, dict],
                progress) -> tuple[list[tuple[float, float]], list[tuple[int, str]]]:
    """([(score, acc)], [(index, error message)]) of (data_source, solution, ground_truth, extra_info) samples (a
    failed sample's is (0, 0)); a registered scorer also gets its data source's `keywords` (and extra_info if it
    was registered with reads_extra_info)."""
    rewards, errors = [], []
    for index, (data_source, solution, ground_truth, extra_info) in enumerate(samples):
        progress[0] = index
        progress[1] = time.monotonic()
        try:
            if custom_fn is not None:
                raw = custom_fn(data_source, solution, ground_truth, extra_info)
            else:
                raw = score(data_source, solution, ground_truth, extra_info, **keywords.get(data_source, {}))
            rewards.append(as_reward(raw))
        except BaseException as err:  # SystemExit too: a scorer's failure costs one sample, not the process
            rewards.append((0.0, 0.0))
            errors.append((index, f"{type(err).__name__}: {err}"[:ERROR_CHARS]))
    progress[1] = IDLE
    return rewards, errors


def exit_when_orphaned(poll_s: float = 1.0) -> None:
    """End this process if the controller dies without closing it (a kill -9), even while a scorer loops."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="orphan-watch").start()


def serve(conn: Connection, progress, code: ScorerCode) -> None:
    try:
        import_user_modules(code.imports)
        custom_fn = load_custom_fn(code.custom_fn) if code.custom_fn else None
    except Exception as err:
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", SCORERS.names()))
    while True:
        try:
            samples = conn.recv()
        except (EOFError, OSError):  # the controller is gone
            return
        if samples is None:  # the controller's close()
            return
        conn.send(("scored", *score_chunk(samples, custom_fn, code.keywords, progress)))


def main(argv: list[str]) -> None:
    exit_when_orphaned()
    serve(Connection(int(argv[0])), progress_view(int(argv[1])), ScorerCode.from_json(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
