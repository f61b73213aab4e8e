"""The agent gateway end to end: users' agents (the official `openai` client, sync and async, and the OpenAI Agents
SDK) over real HTTP, against one real in-process vLLM engine on a tiny tools model, through AgentRunner and
GatewayLoop as build_agent_loop builds them (rollout.agent.function naming this module's agents).

The model is the tool demo's Qwen2 (configs/models/tiny-qwen2-tools' vocabulary and template) with random weights,
its layers switched off (o_proj and down_proj zero: the next token depends on the last one only) and its head
tilted so that after the assistant's opening it often calls `lookup` (one token), and ends its turn after a call:
episodes call, answer and hit limits within a few tokens, each drawn from the run's seeds."""
import asyncio
import os
import threading
import time

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from rl_megatron.agents import AgentRunner, build_agent_loop
from rl_megatron.batch import Prompt, SampleStatus
from rl_megatron.config.schema import AgentConfig, MultiTurnConfig, RolloutConfig
from rl_megatron.data.loader import tokenize_prompts
from rl_megatron.data.lookup import lookup_row
from rl_megatron.models.tiny import TOOLS, write_tiny_model
from rl_megatron.rollout.vllm_engine import VLLMEngine

EOS, OPEN, CALL, NEWLINE = 2, 5, 15, 26  # <|im_end|>, <tool_call> alone (a malformed call), the lookup call, "\n"
NEXT_LOGITS = {NEWLINE: {CALL: 3.0, EOS: 1.0, OPEN: -8.0}, CALL: {EOS: 5.0, OPEN: -8.0}}
LOOKUP = {"type": "function",
          "function": {"name": "lookup", "description": "Look up the secret digit of this question.",
                       "parameters": {"type": "object", "properties": {}, "required": []}}}
BAD_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "objekt"}}}
MAX_MODEL_LEN = 96
RECORDED: dict[str, dict] = {}  # what each episode's agent saw, by the row's name
THIS = __name__


def rollout(function: str | None = None, **agent) -> RolloutConfig:
    """This module's agents run in the test's process (rollout.agent.num_workers=0), where RECORDED is read; the
    examples' in the gateway's agent worker processes."""
    agent = {"num_workers": 0, **agent} if function and function.startswith(THIS) else agent
    return RolloutConfig(n=1, temperature=1.0, max_tokens=3, max_model_len=MAX_MODEL_LEN,
                         agent_loop="single_turn" if function else "tool_agent",
                         agent=AgentConfig(function=function, **agent),
                         multi_turn=MultiTurnConfig(tool_config_path="configs/tools/lookup.yaml",
                                                    max_assistant_turns=2, max_response_length=64))


def tilt(folder: str) -> None:
    weights = load_file(os.path.join(folder, "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    for last, logits in NEXT_LOGITS.items():
        hidden = embed[last] * torch.rsqrt(embed[last].pow(2).mean() + 1e-6)  # the final RMSNorm's output
        for token, logit in logits.items():
            head[token] += (logit - head[token] @ hidden) * hidden / (hidden @ hidden)
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen2-tools")), with_weights=True, seed=0,
                              vocabulary=TOOLS)
    tilt(folder)
    engine = VLLMEngine(folder, rollout(), "float32", seed=0, load_format="auto")
    yield folder, engine, AutoTokenizer.from_pretrained(folder)
    engine.close()


def row(name: str, secret: str = "7", **extra) -> dict:
    data = lookup_row(secret)
    data["extra_info"].update(name=name, **extra)
    return data


def run(model, config: RolloutConfig, rows: list[dict], seeds: list[int], n: int = 1) -> list:
    folder, engine, tokenizer = model
    prompts = [Prompt(tokenize_prompts([r["prompt"]], tokenizer, True, [LOOKUP])[0], r["data_source"],
                      r["ground_truth"], r["extra_info"], r["prompt"]) for r in rows]
    loop = build_agent_loop(config, tokenizer, engine.stop_token_ids, folder)

    async def serve(index, requests):
        return engine.serve(requests)

    try:
        return AgentRunner(loop, "test", serve, 1, len(TOOLS.tokens)).run(prompts, seeds, n, 1.0, "test")
    finally:
        loop.close()


def by_name(samples) -> dict:
    return {s.extra_info["name"]: s for s in samples}


def token_ids(tokenizer, entries) -> list[int]:
    """The ids of a response's tokens, from their log-prob entries or texts (each text is unique in this
    vocabulary)."""
    ids = {tokenizer.decode([i]): i for i in range(len(TOOLS.tokens))}
    return [ids[getattr(entry, "token", entry)] for entry in entries]


# -- the agents ----------------------------------------------------------------------------------------------------

async def agent(base_url: str, data: dict):
    """rollout.agent.function: the row's mode says what this episode does; what it saw goes to RECORDED."""
    info = data["extra_info"]
    seen = RECORDED.setdefault(info["name"], {})
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        return await MODES[info["mode"]](client, base_url, data, seen)


def create(client, messages, **options):
    return client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP], logprobs=True,
                                          **options)


async def forks(client, base_url, data, seen):
    """Extends its history once, then drops the assistant's answer from it: a prefix break."""
    first = (await create(client, data["prompt"])).choices[0]
    question = {"role": "user", "content": "?"}
    second = (await create(client, data["prompt"] + [first.message.model_dump(exclude_none=True), question]))
    seen["dropped"] = data["prompt"] + [question]
    seen["calls"] = [first, second.choices[0], (await create(client, seen["dropped"])).choices[0]]
    return 1.0


async def chats(client, base_url, data, seen):
    if data["extra_info"]["stream"]:
        stream = await create(client, data["prompt"], stream=True, stream_options={"include_usage": True})
        seen["chunks"] = [chunk async for chunk in stream]
    else:
        seen["response"] = await create(client, data["prompt"])
    return 0.75


async def completes(client, base_url, data, seen):
    seen["models"] = await client.models.list()
    first = await client.completions.create(model="policy", prompt="secret?", logprobs=1)
    second = await client.completions.create(model="policy", prompt="secret?" + first.choices[0].text + "?",
                                             logprobs=0)  # 0 top tokens: still each sampled token's log-prob
    seen["calls"] = [first.choices[0], second.choices[0]]
    return 0.5


async def refused(client, base_url, data, seen):
    """Bad requests, each answered in OpenAI's shape, then a good one."""
    root, body = base_url.split("/episodes/")[0], {"model": "policy", "messages": data["prompt"]}
    async with httpx.AsyncClient() as http:
        seen["malformed"] = await http.post(f"{base_url}/chat/completions", content=b'{"model": ',
                                            headers={"content-type": "application/json"})
        seen["unknown"] = await http.post(f"{root}/episodes/nope/v1/chat/completions", json=body)
        seen["no_episode"] = await http.post(f"{root}/v1/chat/completions", json=body)
    for name, changed in (("temperature", {"temperature": 0.5}), ("tool_schema", {"tools": [BAD_TOOL]}),
                          ("long", {"messages": [{"role": "user", "content": "1" * MAX_MODEL_LEN}]})):
        try:
            seen[name] = await client.chat.completions.create(**{**body, **changed})
        except openai.BadRequestError as error:
            seen[name] = error
    seen["after"] = await create(client, data["prompt"])
    return 1.0


async def reports(client, base_url, data, seen):
    seen["response"] = await create(client, data["prompt"])
    return {"reward": 0.25, "turns": 1, "score": 3}


async def fails(client, base_url, data, seen):
    seen["response"] = await create(client, data["prompt"])
    how = data["extra_info"]["how"]
    if how == "raises":
        raise RuntimeError("the harness broke")
    if how == "hangs":
        await asyncio.sleep(3600)
    return "garbage"


MODES = {"forks": forks, "chats": chats, "completes": completes, "refused": refused, "reports": reports,
         "fails": fails}


def sync_agent(base_url: str, data: dict) -> float:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        response = create(client, data["prompt"])
    RECORDED[data["extra_info"]["name"]] = {"response": response, "thread": threading.current_thread()}
    if data["extra_info"].get("hangs"):
        time.sleep(60)  # past rollout.agent.timeout_s: its thread is left to end on its own
    return 0.5


# -- the runs ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def main_run(model):
    """One batch of the async agent's modes, the stream/no-stream pairs drawing from the same seeds."""
    rows = [row("forks", mode="forks"), row("completes", mode="completes"), row("refused", mode="refused"),
            row("reports", mode="reports"), row("bystander", mode="reports")]
    seeds = [1, 2, 3, 4, 5]
    for pair in range(4):
        rows += [row(f"plain{pair}", mode="chats", stream=False), row(f"stream{pair}", mode="chats", stream=True)]
        seeds += [10 + pair] * 2
    return by_name(run(model, rollout(f"{THIS}:agent"), rows, seeds))


@pytest.fixture(scope="module")
def reference(model):
    """The in-process tool loop over 3 lookup rows, 4 samples each."""
    return run(model, rollout(), LOOKUP_ROWS, LOOKUP_SEEDS, n=4)


LOOKUP_ROWS = [row(f"lookup{i}", secret) for i, secret in enumerate("374")]
LOOKUP_SEEDS = [20, 21, 22]


def same_as_the_tool_loop(samples, reference) -> None:
    """The episodes' samples are the tool loop's, token for token, wherever the model made no malformed call."""
    compared = [(s, r) for s, r in zip(samples, reference) if r.tool_stats.errors == 0]
    assert len(compared) >= 10 and any(r.turns == 2 for _, r in compared)  # most episodes, some calling lookup
    for sample, ref in compared:
        assert sample.agent_stats.calls == ref.turns and not sample.agent_stats.failed
        assert sample.agent_stats.prefix_breaks == 0
        assert (sample.prompt_ids, sample.response_ids, sample.loss_mask, sample.status) \
            == (ref.prompt_ids, ref.response_ids, ref.loss_mask, ref.status)
        # the engine's float32 sums differ in their last bits with the batch the request shares
        assert sample.rollout_log_probs == pytest.approx(ref.rollout_log_probs, abs=1e-5)


def test_the_lookup_agent_samples_what_the_tool_loop_samples(model, reference):
    samples = run(model, rollout("examples/agents/lookup_openai.py:lookup_agent", reward="scorer", num_workers=2),
                  LOOKUP_ROWS, LOOKUP_SEEDS, n=4)
    same_as_the_tool_loop(samples, reference)
    assert all(s.agent_reward is None for s in samples)  # the scorer's


def test_the_agents_sdk_agent_samples_what_the_tool_loop_samples(model, reference):
    samples = run(model, rollout("examples/agents/lookup_agents_sdk.py:lookup_agent", reward="scorer"),
                  LOOKUP_ROWS, LOOKUP_SEEDS, n=4)
    assert not any(s.agent_stats.failed for s in samples)
    same_as_the_tool_loop(samples, reference)


def test_a_rewritten_history_forks_and_every_segment_stays_in_the_sample(model, main_run):
    tokenizer, sample, seen = model[2], main_run["forks"], RECORDED["forks"]
    first, second, third = (token_ids(tokenizer, c.logprobs.content) for c in seen["calls"])
    stats = sample.agent_stats
    assert (stats.calls, stats.segments, stats.prefix_breaks) == (3, 2, 1)
    # The second segment (the history without the first answer, rendered afresh) starts where the first ends: its
    # prompt is context (mask 0), then the third call's tokens as sampled.
    (cut,) = sample.segment_starts
    rendered = tokenize_prompts([seen["dropped"]], tokenizer, True, [LOOKUP])[0]
    whole = sample.prompt_ids + sample.response_ids
    assert whole[cut:] == rendered + third
    mask = [0] * len(sample.prompt_ids) + sample.loss_mask
    assert mask[cut:] == [0] * len(rendered) + [1] * len(third)
    # The first segment: the first call's tokens, the question spliced in, the second call's; nothing else trained.
    first_segment = [token for token, on in zip(whole[:cut], mask[:cut]) if on]
    assert first_segment == first + second and sum(sample.loss_mask) == len(first) + len(second) + len(third)
    sampled = [entry.logprob for call in seen["calls"] for entry in call.logprobs.content]
    assert [p for p, on in zip(sample.rollout_log_probs, sample.loss_mask) if on] == sampled


def test_streaming_gives_what_a_plain_call_gives(main_run):
    called = answered = 0
    for pair in range(4):
        plain = RECORDED[f"plain{pair}"]["response"]
        chunks = RECORDED[f"stream{pair}"]["chunks"]
        choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
        message = plain.choices[0].message
        assert "".join(c.delta.content or "" for c in choices) == (message.content or "")
        calls = [call for c in choices for call in c.delta.tool_calls or []]
        assert [(c.id, c.function.name, c.function.arguments) for c in calls] == \
            [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert [c.finish_reason for c in choices if c.finish_reason] == [plain.choices[0].finish_reason]
        assert chunks[-1].usage == plain.usage and not chunks[-1].choices
        streamed = [entry for c in choices if c.logprobs for entry in c.logprobs.content]
        sample, twin = main_run[f"plain{pair}"], main_run[f"stream{pair}"]
        assert twin.rollout_log_probs == [entry.logprob for entry in streamed]  # one per token, as sampled
        assert sample.rollout_log_probs == [entry.logprob for entry in plain.choices[0].logprobs.content]
        assert [e.token for e in streamed] == [e.token for e in plain.choices[0].logprobs.content]
        assert twin.response_ids == sample.response_ids
        assert twin.rollout_log_probs == pytest.approx(sample.rollout_log_probs, abs=1e-5)  # float32, other batches
        called, answered = called + bool(calls), answered + bool(message.content)
    assert called and answered


def test_completions_and_models(model, main_run):
    folder, _, tokenizer = model
    seen, sample = RECORDED["completes"], main_run["completes"]
    assert [m.id for m in seen["models"].data] == [os.path.basename(folder)]
    first, second = seen["calls"]
    ids = [token_ids(tokenizer, c.logprobs.tokens) for c in (first, second)]
    assert sample.prompt_ids == [1, 13, 28]  # <bos> secret ?
    assert sample.response_ids == ids[0] + [28] + ids[1]
    assert sample.loss_mask == [1] * len(ids[0]) + [0] + [1] * len(ids[1])
    assert sample.rollout_log_probs == first.logprobs.token_logprobs + [0.0] + second.logprobs.token_logprobs
    assert sample.agent_stats.segments == 1 and sample.agent_reward == 0.5


def test_bad_requests_are_refused_in_openais_shape_and_the_run_goes_on(model, main_run):
    seen, sample = RECORDED["refused"], main_run["refused"]
    assert seen["malformed"].status_code == 400 and seen["malformed"].json()["error"]["code"] == "invalid_json"
    assert set(seen["malformed"].json()["error"]) == {"message", "type", "param", "code"}
    for name in ("unknown", "no_episode"):
        assert seen[name].status_code == 404 and seen[name].json()["error"]["type"] == "invalid_request_error"
    assert seen["unknown"].json()["error"]["code"] == "episode_not_found"
    assert (seen["temperature"].status_code, seen["temperature"].param) == (400, "temperature")
    assert (seen["tool_schema"].code, seen["tool_schema"].param) == ("invalid_tool_schema",
                                                                    "tools[0].function.parameters")
    assert (seen["long"].status_code, seen["long"].code) == (400, "context_length_exceeded")
    after = seen["after"].choices[0]
    assert sample.response_ids == token_ids(model[2], after.logprobs.content)
    assert (sample.agent_stats.calls, sample.agent_stats.segments, sample.agent_reward) == (1, 1, 1.0)
    assert main_run["bystander"].response_ids and not main_run["bystander"].agent_stats.failed


def test_the_functions_reward_and_metrics(main_run):
    assert main_run["reports"].agent_reward == 0.25
    assert main_run["reports"].agent_stats.metrics == {"turns": 1.0, "score": 3.0}
    assert main_run["plain0"].agent_reward == 0.75 and main_run["plain0"].agent_stats.metrics == {}


def test_failing_agents_end_their_own_episodes_only(model):
    rows = [row(how, mode="fails", how=how) for how in ("raises", "hangs", "garbage")] + [row("fine", mode="reports")]
    samples = by_name(run(model, rollout(f"{THIS}:agent", timeout_s=5.0), rows, [1, 2, 3, 4]))
    for how, why in (("raises", "RuntimeError: the harness broke"), ("hangs", "timed out after"),
                     ("garbage", "returned 'garbage', not a reward")):
        sample = samples[how]
        assert sample.agent_stats.failed and sample.status == SampleStatus.ABORTED, how
        assert (sample.response_ids, sample.agent_reward) == ([], 0.0) and why in sample.error
    assert not samples["fine"].agent_stats.failed and samples["fine"].agent_reward == 0.25
    assert samples["fine"].response_ids == token_ids(model[2], RECORDED["fine"]["response"].choices[0].logprobs.content)


def test_a_failed_episode_is_kept_with_rollout_agent_failed_reward(model):
    rows = [row("kept", mode="fails", how="raises"), row("kept_fine", mode="reports")]
    samples = by_name(run(model, rollout(f"{THIS}:agent", failed_reward=-1.0), rows, [6, 7]))
    kept = samples["kept"]
    assert kept.agent_stats.failed and kept.agent_reward == -1.0
    assert kept.response_ids == token_ids(model[2], RECORDED["kept"]["response"].choices[0].logprobs.content)
    assert kept.loss_mask == [1] * len(kept.response_ids)
    assert samples["kept_fine"].agent_reward == 0.25 and not samples["kept_fine"].agent_stats.failed


def test_a_plain_function_with_the_sync_client_runs_in_a_thread(model):
    start = time.monotonic()
    samples = by_name(run(model, rollout(f"{THIS}:sync_agent", timeout_s=5.0),
                          [row("sync0"), row("sync1"), row("sync_hangs", hangs=True)], [8, 9, 10]))
    assert time.monotonic() - start < 30  # the rollout does not wait for the hanging thread
    hung = samples.pop("sync_hangs")
    assert hung.agent_stats.failed and hung.status == SampleStatus.ABORTED and "timed out" in hung.error
    for name, sample in samples.items():
        seen = RECORDED[name]
        assert seen["thread"] is not threading.main_thread() and sample.agent_reward == 0.5
        assert sample.response_ids == token_ids(model[2], seen["response"].choices[0].logprobs.content)
        assert sample.rollout_log_probs == [e.logprob for e in seen["response"].choices[0].logprobs.content]
