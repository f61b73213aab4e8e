"""rollout.multi_turn.format: auto picks harmony for gpt-oss's chat template (tests/data/gpt_oss_chat_template.jinja)
and hermes for the Hermes demo template; an unknown value is a ConfigError naming the key. The tool agent over
scripted harmony turns with the real lookup tool: token in, token out, the template's rendering at the second turn,
the reward reading the final channel, errors for bad calls."""
import asyncio
import re

import pytest

from helpers.harmony import TEMPLATE, call_message, char_tokenizer, encode, render, stop_ids
from rl_megatron.agents import ChatDeltas, HarmonyDeltas, ToolAgentLoop, build_agent_loop
from rl_megatron.batch import Prompt, SampleStatus
from rl_megatron.config import ConfigError, load
from rl_megatron.config.choices import TOOL_FORMATS
from rl_megatron.config.schema import MultiTurnConfig, RolloutConfig
from rl_megatron.data.lookup import lookup_row
from rl_megatron.models.tiny import TOOL_CHAT_TEMPLATE, TOOLS, build_tokenizer
from rl_megatron.rewards.scorer import answer_text, reward_extra_info
from rl_megatron.rollout.completions import Completion
from rl_megatron.tools import ToolSet
from rl_megatron.tools.harmony import HARMONY, HERMES, resolve_tool_format

LOOKUP_TOOLS = "configs/tools/lookup.yaml"
TEMPLATE_CALL = " to=functions.lookup<|channel|>commentary json<|message|>{}<|call|>"  # as the template writes it
SPEC_CALL = "<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{}<|call|>"  # as harmony's spec
ANSWER = "<|channel|>analysis<|message|>The tool said 7.<|end|><|start|>assistant<|channel|>final<|message|>7<|return|>"
OK, CUT = SampleStatus.OK, SampleStatus.TRUNCATED


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def tools():
    return ToolSet.from_config_file(LOOKUP_TOOLS)


def rollout_of(**multi_turn) -> RolloutConfig:
    return RolloutConfig(agent_loop="tool_agent", max_tokens=200, multi_turn=MultiTurnConfig(
        **{"tool_config_path": LOOKUP_TOOLS, "max_response_length": 1000, **multi_turn}))


def prompt_of(tokenizer, tools) -> Prompt:
    row = lookup_row("7")
    ids = encode(tokenizer, render(tokenizer, row["prompt"], tools.schemas(), add_generation_prompt=True))
    return Prompt(ids, row["data_source"], row["ground_truth"], row["extra_info"], row["prompt"])


def run(loop, prompt, turns: list[str]):
    """The loop over scripted turns (each the text the model writes); the sample and the contexts it was asked to
    continue."""
    tokenizer, asked = loop.context.tokenizer, []
    stops = stop_ids(tokenizer)

    async def generate(token_ids, max_tokens=None):
        ids = encode(tokenizer, turns[len(asked)])
        asked.append(list(token_ids))
        return Completion(ids, [-0.5] * len(ids), OK if ids[-1] in stops else CUT)

    return asyncio.run(loop.run(prompt, generate)), asked


def test_auto_follows_the_chat_template_and_an_explicit_format_is_kept():
    assert resolve_tool_format("auto", TEMPLATE) == HARMONY
    assert resolve_tool_format("auto", TOOL_CHAT_TEMPLATE) == HERMES
    assert resolve_tool_format("auto", None) == HERMES  # no template: ChatDeltas then says what is missing
    assert resolve_tool_format("auto", {"default": TEMPLATE}) == HARMONY  # a tokenizer's named templates
    assert resolve_tool_format(HARMONY, TEMPLATE) == HARMONY and resolve_tool_format(HERMES, None) == HERMES
    assert TOOL_FORMATS == ("auto", HERMES, HARMONY) and RolloutConfig().multi_turn.format == "auto"


def test_an_unknown_format_or_hermes_on_a_harmony_template_is_a_config_error():
    expected = "rollout.multi_turn.format='xml' is unknown: use one of auto, hermes, harmony."
    with pytest.raises(ConfigError) as info:
        load(None, ["model.path=m", "rollout.multi_turn.format=xml"])
    assert str(info.value) == expected
    with pytest.raises(ConfigError) as info:
        resolve_tool_format("xml", TEMPLATE)
    assert str(info.value) == expected
    with pytest.raises(ConfigError, match="format=hermes, but model.path's chat template writes gpt-oss's harmony"):
        resolve_tool_format(HERMES, TEMPLATE)
    assert load(None, ["model.path=m", "rollout.multi_turn.format=harmony"]).rollout.multi_turn.format == HARMONY


def test_the_agent_loop_gets_the_formats_deltas(tokenizer):
    loop = build_agent_loop(rollout_of(), tokenizer, stop_ids(tokenizer))
    assert isinstance(loop, ToolAgentLoop) and isinstance(loop.context.deltas, HarmonyDeltas)
    hermes = build_tokenizer(TOOLS)
    assert isinstance(build_agent_loop(rollout_of(), hermes, [2]).context.deltas, ChatDeltas)
    with pytest.raises(ConfigError, match="rollout.agent_loop=tool_agent: rollout.multi_turn.format=harmony needs "
                                          "gpt-oss's chat template"):
        build_agent_loop(rollout_of(format=HARMONY), hermes, [2])
    with pytest.raises(ConfigError, match=re.escape("<|call|>, which is not one of the tokens generation stops at")):
        build_agent_loop(rollout_of(), tokenizer, tokenizer.convert_tokens_to_ids(["<|return|>"]))


@pytest.mark.parametrize("call", [TEMPLATE_CALL, "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant"
                                  + TEMPLATE_CALL])
def test_a_harmony_trajectory_reads_the_templates_rendering_and_is_scored_on_its_final_channel(tokenizer, tools, call):
    loop = build_agent_loop(rollout_of(), tokenizer, stop_ids(tokenizer))
    prompt = prompt_of(tokenizer, tools)
    sample, asked = run(loop, prompt, [call, ANSWER])
    thinking = "Look it up." if "analysis" in call else None
    conversation = prompt.messages + [call_message("lookup", {}, thinking), {"role": "tool", "content": "7"}]
    # What the model reads for its second turn: exactly the template's tokens for the conversation.
    assert asked[1] == encode(tokenizer, render(tokenizer, conversation, tools.schemas(), add_generation_prompt=True))
    first, last = encode(tokenizer, call), encode(tokenizer, ANSWER)
    assert sample.response_ids[:len(first)] == first and sample.response_ids[-len(last):] == last  # as sampled
    spliced = len(sample.response_ids) - len(first) - len(last)
    assert sample.loss_mask == [1] * len(first) + [0] * spliced + [1] * len(last)
    assert sample.status == OK and sample.turns == 2 and sample.tool_stats.by_tool == {"lookup": 1}
    # The reward reads the final channel, never the analysis; the conversation keeps the template's fields.
    assert answer_text(sample, tokenizer) == "7"
    messages = reward_extra_info(sample)["messages"]
    assert messages[-3:] == [call_message("lookup", {}, thinking) | {"content": ""},
                             {"role": "tool", "content": "7", "name": "lookup"},
                             {"role": "assistant", "content": "7", "thinking": "The tool said 7."}]


def test_the_spec_form_a_cut_off_call_and_bad_calls(tokenizer, tools):
    loop = build_agent_loop(rollout_of(), tokenizer, stop_ids(tokenizer))
    prompt = prompt_of(tokenizer, tools)
    # The harmony spec's form of the call runs the same tool; the model's own tokens stay as it wrote them.
    sample, asked = run(loop, prompt, [SPEC_CALL, ANSWER])
    assert sample.tool_stats.by_tool == {"lookup": 1} and answer_text(sample, tokenizer) == "7"
    assert tokenizer.decode(asked[1][len(prompt.ids):]).startswith(SPEC_CALL + "<|start|>functions.lookup ")
    # Cut off inside its call: the splice closes the call (<|call|>) before the error reply.
    cut = SPEC_CALL[:-len("}<|call|>")]
    sample, asked = run(loop, prompt, [cut, ANSWER])
    assert sample.tool_stats.errors == 1 and "was cut off" in sample.messages[-2]["content"]
    assert tokenizer.decode(asked[1][len(prompt.ids):]).startswith(cut + "<|call|><|start|>functions.lookup ")
    # Bad JSON, then a recipient that is no function: each answered with an error, from the tool it named.
    bad_json = SPEC_CALL.replace("{}", "{oops")
    browser = "<|channel|>commentary to=browser.search <|constrain|>json<|message|>{}<|call|>"
    sample, asked = run(loop, prompt, [bad_json, browser, ANSWER])
    assert len(asked) == 3 and sample.status == OK and answer_text(sample, tokenizer) == "7"
    assert sample.tool_stats.calls == 2 and sample.tool_stats.errors == 2 and sample.tool_stats.by_tool == {}
    replies = [m for m in sample.messages if m["role"] == "tool"]
    assert [m["name"] for m in replies] == ["lookup", "browser.search"]
    assert "not valid JSON" in replies[0]["content"] and "not one of your functions" in replies[1]["content"]
    assert "<|start|>functions.browser.search to=assistant" in tokenizer.decode(asked[2])
