"""The engine's MoE routing of every token it computes (`moe.engine_routing`): what R3 replays in the trainer
(`actor.router_replay=R3`) and what `moe/routing_agreement` compares the trainer's own routing with.

A sample's routing is a [positions, MoE layers, top-k] array of expert ids (int16), row p the experts the engine sent
position p to when it fed that token (prompt and response; P + R - 1 rows: the last sampled token is never fed).

Two ways, one per device, the same result:
- CUDA: vLLM's own capture (`enable_return_routed_experts`, on its Model Runner V2, the default there), which fills
  `CompletionOutput.routed_experts` for every layer; the MoE layers' columns are kept.
- CPU: vLLM's CPU backend has no Model Runner V2 (it needs Triton), so the routing is captured here, with the same
  hook vLLM's capture uses: each MoE layer's router calls back with the step's top-k ids ([step tokens, k]), and the
  step's rows are put at their requests' positions (the model runner's batch: request order, tokens per request,
  tokens computed before the step). Every position is computed by its own request when prefix caching is off, which
  `engine_arguments` ensures on CPU while this runs (cached prompt blocks would have no rows).
"""
from __future__ import annotations

from functools import partial

import numpy as np
import torch

ROUTING_DTYPE = np.int16  # expert ids below 32768


def moe_layer_ids(model: torch.nn.Module) -> list[int]:
    """The decoder layers of a vLLM model that route (a mixed model's dense layers do not), in order."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    return sorted(module.layer_id for module in model.modules() if isinstance(module, MoERunner))


class EngineRouting:
    """The routing of each completion of a vLLM engine in this process: vLLM's own (`captured`=False, CUDA) or
    captured here (CPU)."""

    def __init__(self, runner, requests: dict, captured: bool):
        """`runner`: the engine's model runner; `requests`: its output processor's request states."""
        self.layers = moe_layer_ids(runner.get_model())
        if not self.layers:
            raise ValueError("moe.engine_routing returns MoE routing, but the engine's model has no MoE layer: set "
                             "moe.engine_routing=false")
        self.capture = RoutingCapture(runner, requests, self.layers) if captured else None

    def of(self, output, sample) -> np.ndarray | None:
        """The routing of `sample` (a CompletionOutput of the RequestOutput `output`): every position the engine fed,
        [prompt + response - 1, MoE layers, top-k]; of a request cut off unfinished, what it fed so far (None if
        nothing, or on CUDA, where vLLM returns the routing of finished requests only)."""
        positions = len(output.prompt_token_ids) + len(sample.token_ids) - 1
        if self.capture is not None:
            return self.capture.take(output.request_id, sample.index, positions, whole=output.finished)
        if sample.routed_experts is None:
            return None
        return sample.routed_experts[:positions, self.layers].astype(ROUTING_DTYPE)

    def of_cut(self, request_id: str, positions: int) -> np.ndarray | None:
        """What the engine fed of request `request_id` (one sample), cut off unfinished after `positions` positions
        (None if nothing, and on CUDA, as `of`)."""
        return None if self.capture is None else self.capture.take(request_id, 0, positions, whole=False)

    def forget(self) -> None:
        """Drop the routing no completion took (requests aborted by `interrupt`)."""
        if self.capture is not None:
            self.capture.forget()


class RoutingCapture:
    """Captures the routing of every request a CPU vLLM engine (in this process) computes, by (request id as given
    to vLLM, sample index), until `take` hands it out."""

    def __init__(self, runner, requests: dict, layers: list[int]):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        self.runner = runner
        self.requests = requests  # vLLM's own id -> its request as given
        model = runner.get_model()
        self.columns = len(layers)
        self.step_rows: torch.Tensor | None = None  # [step tokens, MoE layers, k]: the step being computed
        self.step = None  # (requests, first row of each, positions computed before the step)
        self.routing: dict[tuple[str, int], np.ndarray] = {}  # grown by doubling: rows past `filled` are unused
        self.filled: dict[tuple[str, int], int] = {}
        for module in model.modules():
            if isinstance(module, MoERunner):
                if not isinstance(module.router, BaseRouter) or module._quant_method.is_monolithic:
                    raise ValueError(f"layer {module.layer_id}'s MoE kernel ({type(module.router).__name__}) has no "
                                     "routing hook: set moe.engine_routing=false (and actor.router_replay to "
                                     "disabled or R2)")
                module.router.set_capture_fn(partial(self._capture, layers.index(module.layer_id)))

    def _capture(self, column: int, topk_ids: torch.Tensor) -> None:
        if column == 0:  # a new step: the routers are called in layer order
            self._flush()
            batch = self.runner.input_batch
            count = batch.num_reqs
            # Keyed as the caller knows them (vLLM forgets a request's own id once it has finished).
            keys = [(state.external_req_id, state.request_index)
                    for state in map(self.requests.__getitem__, batch.req_ids[:count])]
            self.step = (keys, self.runner.query_start_loc.np[:count + 1].copy(),
                         batch.num_computed_tokens_cpu[:count].copy())
            self.step_rows = torch.empty(topk_ids.shape[0], self.columns, topk_ids.shape[1], dtype=torch.int16)
        self.step_rows[:, column] = topk_ids

    def _flush(self) -> None:
        """The finished step's rows, to their requests' positions."""
        if self.step is None:
            return
        rows = self.step_rows.numpy()
        for key, start, end, computed in zip(self.step[0], self.step[1][:-1], self.step[1][1:], self.step[2]):
            known = self.routing.get(key)
            needed = computed + end - start
            if known is None or known.shape[0] < needed:
                grown = np.zeros((max(needed, 2 * (0 if known is None else known.shape[0])), *rows.shape[1:]),
                                 dtype=ROUTING_DTYPE)
                if known is not None:
                    grown[:known.shape[0]] = known
                known = self.routing[key] = grown
            known[computed:needed] = rows[start:end]
            self.filled[key] = max(self.filled.get(key, 0), needed)
        self.step = self.step_rows = None

    def take(self, request_id: str, index: int, positions: int, whole: bool) -> np.ndarray | None:
        """The routing of sample `index` of request `request_id` at its first `positions` positions, forgotten
        here; `whole`=False (a request cut off): what it has of them (None if nothing)."""
        self._flush()
        known, filled = self.routing.pop((request_id, index), None), self.filled.pop((request_id, index), 0)
        if not whole:
            return known[:min(filled, positions)].copy() if filled else None
        if filled < positions:
            raise RuntimeError(f"the engine's routing of request {request_id} (sample {index}) has {filled} of its "
                               f"{positions} positions")
        return known[:positions].copy()

    def forget(self) -> None:
        """Drop what no one took (e.g. requests aborted without being handed out)."""
        self._flush()
        self.routing.clear()
        self.filled.clear()
