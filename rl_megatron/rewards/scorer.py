"""`RewardScorer`: the trainer's one entry point for rewards, scoring a step's samples in a pool of processes.

Why processes (not threads, not Ray actors): rule-based scorers are pure Python, so threads would serialise
on the GIL; a process can also be killed when a scorer hangs (a thread cannot), and a small local pool is
cheaper than actors and testable without Ray. The pool lives across steps; a step's samples go out in a few
chunks per process (one message each way per chunk), and `submit` returns at once, so the trainer can
overlap scoring with its next phase.

A sample whose scorer raises, returns a non-number (score or "acc"), or runs past `reward.timeout_s` scores 0
(acc 0) and is counted (`reward/errors`, `reward/timeouts`) and logged; a process past the timeout is killed with
its process group and replaced, so hung scorers never pile up.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import signal
import socket
import subprocess
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

import torch

from rl_megatron.batch import Sample, ToolStats
from rl_megatron.plugins import import_user_modules, module_process, with_absolute_path
from rl_megatron.rewards import SCORERS, keywords_from_config
from rl_megatron.rewards.custom import load_custom_fn
from rl_megatron.rewards.worker import IDLE, PROGRESS_BYTES, ScorerCode, progress_view

logger = logging.getLogger(__name__)

CHUNKS_PER_WORKER = 4  # a few chunks per process balance uneven scorers at a few messages per step
STARTUP_TIMEOUT_S = 60.0  # a scorer process must import its scorer within this
MAX_POLL_S = 0.1  # how often a busy pool checks the clock when no message arrives


class _ScorerProcess:
    """One worker process: its connection, its shared progress record, and the chunk it is scoring."""

    def __init__(self, code: ScorerCode):
        ours, theirs = socket.socketpair()
        progress_fd = os.memfd_create("rl_megatron-reward-progress")
        os.ftruncate(progress_fd, PROGRESS_BYTES)
        try:
            self.process = module_process("rl_megatron.rewards.worker",
                                          [str(theirs.fileno()), str(progress_fd), code.to_json()],
                                          (theirs.fileno(), progress_fd))
            self.progress = progress_view(progress_fd)
        finally:
            theirs.close()
            os.close(progress_fd)
        self.conn = Connection(ours.detach())
        self.started_at = time.monotonic()
        self.ready = False
        self.chunk: tuple[int, list] | None = None  # (index of its first sample in the batch, samples)
        self.hung_up = False  # its end of the connection closed: it died (maybe not yet reaped)

    def send(self, chunk: tuple[int, list]) -> None:
        self.chunk = chunk
        self.conn.send(chunk[1])

    def current_sample(self) -> tuple[int, float] | None:
        """(index in the chunk, seconds it has run) of the sample being scored; None between samples."""
        index, started, index_again = self.progress[0], self.progress[1], self.progress[0]
        if started == IDLE or index != index_again:  # idle, or moved on while we looked
            return None
        return int(index), time.monotonic() - started

    def kill(self) -> None:
        if self.process.returncode is None:  # not reaped yet, so its pid (the group's id) cannot be reused
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.process.wait()
        self.conn.close()

    def stop(self, grace_s: float = 2.0) -> None:
        """Ask an idle process to exit, killing it if it does not within grace_s; kill a busy one at once."""
        if self.chunk is None and self.process.poll() is None:
            try:
                self.conn.send(None)
                self.process.wait(grace_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def _stop_all(processes: list[_ScorerProcess]) -> None:
    for process in processes:
        process.stop()


@dataclass
class Scored:
    """A batch's rewards. `scores`: float32, the scorer's reward per sample; `acc`: float32 per sample, the "acc"
    entry of a verl-style dict (DAPO logs it beside the shaped reward and filters groups on it), else the score;
    `stats`: {"reward/timeouts": n, "reward/errors": n}. A sample whose scorer failed has score 0 and acc 0."""
    scores: torch.Tensor
    acc: torch.Tensor
    stats: dict[str, int]


@dataclass
class _BatchProblems:
    """The samples of a batch that scored 0 because their scorer failed, and the first such failure."""
    timeouts: int = 0
    errors: int = 0
    first: list[str] = field(default_factory=list)

    def add(self, kind: str, sample: tuple, message: str) -> None:
        if kind == "timeout":
            self.timeouts += 1
        else:
            self.errors += 1
        if not self.first:
            self.first.append(f"data_source={sample[0]!r}: {message}")


def answer_text(sample: Sample, tokenizer) -> str:
    """What the reward reads as the answer: the response's text, or a multi-turn sample's last assistant message (its
    final answer; the whole conversation is in the extra info)."""
    if sample.messages is not None:
        return next((m["content"] for m in reversed(sample.messages) if m["role"] == "assistant"), "")
    return tokenizer.decode(sample.response_ids, skip_special_tokens=True)


def reward_extra_info(sample: Sample) -> dict:
    """The row's extra info, and for a multi-turn sample (verl's keys) the conversation (`messages`), `num_turns` and `tool_stats` (calls, errors, timeouts, by_tool)."""
    if sample.messages is None:
        return sample.extra_info
    stats = sample.tool_stats or ToolStats()
    return sample.extra_info | {
        "messages": sample.messages, "num_turns": sample.turns,
        "tool_stats": {"calls": stats.calls, "errors": stats.errors, "timeouts": stats.timeouts,
                       "by_tool": dict(stats.by_tool)}}


class RewardScorer:
    """Scores samples with the registered scorer of each one's data_source, or with `reward.custom_fn`.

    with RewardScorer(cfg.reward, cfg.trainer.imports) as scorer:
        scored = scorer.score(data_sources, responses, ground_truths, extra_infos, prompts=prompts)
    """

    def __init__(self, cfg, imports: list[str] = ()):
        """cfg: a RewardConfig (num_workers, timeout_s, custom_fn, and the keys scorers read: gsm8k_match,
        math_match); `imports`: the user's modules (trainer.imports) that the processes import first, so that the
        scorers they register exist there too. A bad custom_fn or import raises ConfigError here."""
        self.timeout_s = float(cfg.timeout_s)
        custom_fn = with_absolute_path(cfg.custom_fn) if cfg.custom_fn else None
        imports = [with_absolute_path(name) for name in imports]
        # Fail at start, in the controller, with the config key named. Imported before the keywords are read, so
        # that a user's scorer registered under a built-in's name gets only the keywords it asks for.
        import_user_modules(imports)
        if custom_fn:
            load_custom_fn(custom_fn)
        self.code = ScorerCode(custom_fn, imports, keywords_from_config(cfg))
        self.custom_fn_spec = self.code.custom_fn
        self.sources: set[str] = set()  # the data sources the processes have a scorer for (they say when ready)
        self._processes = [_ScorerProcess(self.code) for _ in range(cfg.num_workers)]
        # Kills the processes even if close() is never called (an exception, or the end of the interpreter).
        self._finalizer = weakref.finalize(self, _stop_all, self._processes)
        try:
            self._wait_until_ready()
        except BaseException:
            self.close()
            raise
        # One thread runs batches, in order; it alone touches the processes after start-up.
        self._runner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward-scorer")

    def submit(self, data_sources, solutions, ground_truths, extra_infos=None,
               prompts=None) -> concurrent.futures.Future:
        """Start scoring; the future's result is what `score` returns. Sample i is (data_sources[i],
        solutions[i] (the response text), ground_truths[i], extra_infos[i]); prompts[i] is the prompt text,
        which scorers of sources registered with reads_prompt (countdown) see before the response."""
        if not self._finalizer.alive:
            raise RuntimeError("this RewardScorer is closed; create a new one")
        samples = self._samples(list(data_sources), list(solutions), list(ground_truths),
                                None if extra_infos is None else list(extra_infos),
                                None if prompts is None else list(prompts))
        return self._runner.submit(self._score_batch_or_reset, samples)

    def submit_samples(self, samples: list[Sample], tokenizer) -> concurrent.futures.Future:
        """`submit` for a step's samples, decoded with `tokenizer`. Prompts keep their special tokens: scorers look
        for the chat template's markers (<|im_start|>assistant). A sample whose agent gave its reward
        (`Sample.agent_reward`, rollout.agent.reward=function) is not sent to a scorer: that is its score and acc."""
        scored_here = [i for i, s in enumerate(samples) if s.agent_reward is None]
        prompt_texts: dict[tuple[int, ...], str] = {}
        for i in scored_here:  # the n samples of a prompt share its text
            ids = tuple(samples[i].prompt_ids)
            if ids not in prompt_texts:
                prompt_texts[ids] = tokenizer.decode(samples[i].prompt_ids)
        rest = [samples[i] for i in scored_here]
        scoring = self.submit([s.data_source for s in rest], [answer_text(s, tokenizer) for s in rest],
                              [s.ground_truth for s in rest], [reward_extra_info(s) for s in rest],
                              prompts=[prompt_texts[tuple(s.prompt_ids)] for s in rest])
        if len(scored_here) == len(samples):
            return scoring
        merged: concurrent.futures.Future = concurrent.futures.Future()

        def merge(done: concurrent.futures.Future) -> None:
            try:
                scored = done.result()
            except BaseException as error:  # noqa: BLE001 - the caller's result() raises it
                merged.set_exception(error)
                return
            scores = torch.tensor([0.0 if s.agent_reward is None else float(s.agent_reward) for s in samples])
            acc = scores.clone()
            index = torch.tensor(scored_here, dtype=torch.long)
            scores[index], acc[index] = scored.scores, scored.acc
            merged.set_result(Scored(scores, acc, scored.stats))

        scoring.add_done_callback(merge)
        return merged

    def score(self, data_sources, solutions, ground_truths, extra_infos=None,
              prompts=None) -> Scored:
        """The samples' `Scored` (scores, acc, timeout and error counts); see `submit`."""
        return self.submit(data_sources, solutions, ground_truths, extra_infos, prompts).result()

    def close(self) -> None:
        if hasattr(self, "_runner"):
            self._runner.shutdown(wait=True)
        self._finalizer()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _samples(self, data_sources, solutions, ground_truths, extra_infos, prompts) -> list[tuple]:
        n = len(data_sources)
        for name, values in (("solutions", solutions), ("ground_truths", ground_truths),
                             ("extra_infos", extra_infos), ("prompts", prompts)):
            if values is not None and len(values) != n:
                raise ValueError(f"RewardScorer: {len(values)} {name} for {n} data_sources; pass one per sample")
        extra_infos = extra_infos or [None] * n
        if self.custom_fn_spec is None:  # unknown sources are a data or config bug: stop before scoring
            for source in dict.fromkeys(data_sources):
                if source in SCORERS and source not in self.sources:
                    raise KeyError(f"data_source {source!r} has a scorer registered in this process but not in the "
                                   "scorer processes, which import only the built-in scorers and trainer.imports: "
                                   "add the module that registers it to trainer.imports.")
                if source not in self.sources:  # registered nowhere
                    SCORERS.check(source)
            reads_prompt = SCORERS.with_trait("reads_prompt")
            with_prompt = [source in reads_prompt for source in data_sources]
            if any(with_prompt) and prompts is None:
                source = data_sources[with_prompt.index(True)]
                raise ValueError(f"data_source {source!r} is scored on the prompt followed by the response "
                                 "(TinyZero's countdown reads the text after the prompt's 'Assistant:' marker); "
                                 "pass prompts=[prompt text per sample] to RewardScorer.score")
            solutions = [prompt + solution if read and isinstance(prompt, str) and isinstance(solution, str)
                         else solution
                         for read, prompt, solution in zip(with_prompt, prompts or [None] * n, solutions)]
        return list(zip(data_sources, solutions, ground_truths, extra_infos))

    def _wait_until_ready(self) -> None:
        while not all(p.ready for p in self._processes):
            starting = [p for p in self._processes if not p.ready]
            wait([p.conn for p in starting], timeout=MAX_POLL_S)
            for process in starting:
                self._check_start(process)

    def _check_start(self, process: _ScorerProcess) -> None:
        """Mark the process ready once it says so; raise if it failed or is too slow to start."""
        if process.conn.poll():
            try:
                message = process.conn.recv()
            except (EOFError, OSError):
                message = ("failed", f"it exited with code {process.process.wait()} (see its output above)")
            if message[0] != "ready":
                raise RuntimeError(f"a reward scorer process failed to start: {message[1]}")
            self.sources = set(message[1])
            process.ready = True
        elif time.monotonic() - process.started_at > STARTUP_TIMEOUT_S:
            raise RuntimeError(f"a reward scorer process did not start within {STARTUP_TIMEOUT_S:.0f}s (importing "
                               f"reward.custom_fn={self.custom_fn_spec!r} hangs?)")

    def _score_batch_or_reset(self, samples: list[tuple]) -> Scored:
        try:
            return self._score_batch(samples)
        except BaseException:
            # A busy process would answer a chunk of this failed batch during the next one: replace it.
            for slot, process in enumerate(self._processes):
                if process.chunk is not None:
                    process.kill()
                    self._processes[slot] = _ScorerProcess(self.code)
            raise

    def _score_batch(self, samples: list[tuple]) -> Scored:
        rewards = [(0.0, 0.0)] * len(samples)  # (score, acc) per sample; a failed one keeps (0, 0)
        problems = _BatchProblems()
        size = max(1, math.ceil(len(samples) / (len(self._processes) * CHUNKS_PER_WORKER)))
        pending = deque((start, samples[start : start + size]) for start in range(0, len(samples), size))
        # Each replacement charges a sample, except for a process that died between samples (killed from
        # outside): the bound only stops a pool whose processes keep dying from looping forever.
        replacements_left = len(samples) + len(self._processes)
        while pending or any(p.chunk for p in self._processes):
            for process in self._processes:
                if process.ready and process.chunk is None and pending:
                    process.send(pending.popleft())
            wait([p.conn for p in self._processes if p.chunk or not p.ready], timeout=self._poll_timeout())
            # Replacing in place keeps the finalizer's list (the same object) current.
            for slot, process in enumerate(self._processes):
                if not process.ready:
                    self._check_start(process)
                elif process.chunk and not self._collect(process, rewards, problems):
                    if replacements_left == 0:
                        raise RuntimeError("reward scorer processes keep dying between samples; see their output")
                    replacements_left -= 1
                    self._processes[slot] = self._replace(process, pending, problems)
        if problems.timeouts or problems.errors:
            logger.warning("reward: %d of %d samples scored 0 because their scorer failed (%d timed out after "
                           "reward.timeout_s=%gs, %d raised, crashed or returned a non-number); first: %s",
                           problems.timeouts + problems.errors, len(samples), problems.timeouts, self.timeout_s,
                           problems.errors, problems.first[0])
        scores, acc = torch.tensor(rewards, dtype=torch.float32).reshape(-1, 2).T.contiguous()
        return Scored(scores, acc, {"reward/timeouts": problems.timeouts, "reward/errors": problems.errors})

    def _poll_timeout(self) -> float:
        """Seconds until the earliest running sample reaches the timeout, at most MAX_POLL_S."""
        left = [self.timeout_s - running[1] for p in self._processes
                if p.chunk and (running := p.current_sample()) is not None]
        return max(0.0, min([MAX_POLL_S, *left]))

    def _collect(self, process: _ScorerProcess, rewards: list[tuple[float, float]],
                 problems: _BatchProblems) -> bool:
        """Take the process's answer if it has one; False if it must be replaced (timed out or died)."""
        start, chunk = process.chunk
        try:
            answered = process.conn.poll()
            message = process.conn.recv() if answered else None
        except (EOFError, OSError):
            process.hung_up = True
            return False
        if message is None:
            running = process.current_sample()
            return running is None or running[1] <= self.timeout_s
        _, chunk_rewards, errors = message
        rewards[start : start + len(chunk)] = chunk_rewards
        for index, error in errors:
            problems.add("error", chunk[index], error)
        process.chunk = None
        return True

    def _replace(self, process: _ScorerProcess, pending: deque, problems: _BatchProblems) -> _ScorerProcess:
        """Kill a timed-out or dead process, charge its current sample, re-queue the rest of its chunk (the
        scores it had finished died with it), and start a fresh process in its place."""
        running = process.current_sample()
        alive = process.process.poll() is None and not process.hung_up
        process.kill()
        start, chunk = process.chunk
        if running is None:  # died between samples: no sample to blame
            pending.appendleft((start, chunk))
        else:
            index = running[0]
            if alive:
                problems.add("timeout", chunk[index], f"still running after {running[1]:.1f}s; its process was "
                                                      "killed")
            else:
                problems.add("error", chunk[index], f"its scorer process died (exit code "
                                                    f"{process.process.returncode})")
            for rest in ((start + index + 1, chunk[index + 1 :]), (start, chunk[:index])):
                if rest[1]:
                    pending.appendleft(rest)
        return _ScorerProcess(self.code)
