"""The gateway's OpenAI API (rl_megatron/agents/gateway/openai_api.py): requests checked into typed values, each
refusal naming its key in OpenAI's error shape, and the stream chunks built from a response."""
import json

import pytest

from rl_megatron.agents.gateway.openai_api import (ApiError, RunSampling, chat_chunks, chat_completion,
                                                   parse_chat_request, parse_completion_request, server_sent_events,
                                                   text_chunks, text_completion)

RUN = RunSampling(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16)
USER = {"role": "user", "content": "secret?"}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def chat(**body):
    return parse_chat_request({"model": "policy", "messages": [USER], **body}, RUN)


def refused(parse, body) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body, RUN)
    assert caught.value.status == 400 and caught.value.kind == "invalid_request_error"
    return caught.value


@pytest.mark.parametrize("key, value, code", [
    ("temperature", 0.7, "unsupported_value"), ("top_p", 0.9, "unsupported_value"), ("top_k", 5, "unsupported_value"),
    ("presence_penalty", 0.5, "unsupported_parameter"), ("frequency_penalty", -1.0, "unsupported_parameter"),
    ("repetition_penalty", 1.2, "unsupported_parameter"), ("logit_bias", {"17": 5}, "unsupported_parameter"),
    ("n", 2, "unsupported_value"), ("response_format", {"type": "json_object"}, "unsupported_parameter"),
    ("top_logprobs", 3, "unsupported_parameter"), ("tool_choice", "required", "unsupported_value"),
    ("tool_choice", {"type": "function", "function": {"name": "lookup"}}, "unsupported_value"),
    ("max_tokens", 0, None), ("max_tokens", "8", None), ("max_tokens", True, None),
    ("max_completion_tokens", -3, None), ("stop", ["a", "b", "c", "d", "e"], None), ("stop", [""], None),
    ("stop", 7, None), ("logprobs", "yes", None), ("stream", "yes", None), ("stream_options", "usage", None),
])
def test_what_would_change_or_constrain_the_policys_sampling_is_refused_naming_its_key(key, value, code):
    error = refused(parse_chat_request, {"messages": [USER], key: value})
    assert (error.param, error.code) == (key, code)
    assert error.body() == {"error": {"message": error.message, "type": "invalid_request_error", "param": key,
                                      "code": code}}


@pytest.mark.parametrize("messages, param", [
    (None, "messages"), ([], "messages"), ({"role": "user"}, "messages"),
    (["hi"], "messages[0].role"), ([{"role": "robot", "content": "hi"}], "messages[0].role"),
    ([USER, {"role": "user", "content": 3}], "messages[1].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content"),
    ([USER, {"role": "tool", "content": "7"}], "messages[1].tool_call_id"),
    ([USER, {"role": "assistant", "content": "", "tool_calls": "lookup"}, USER], "messages[1].tool_calls"),
    ([USER, {"role": "assistant", "tool_calls": [{"name": "lookup"}]}, USER], "messages[1].tool_calls[0]"),
    ([USER, {"role": "assistant", "tool_calls": [{"function": {"name": "lookup", "arguments": "{x"}}]}, USER],
     "messages[1].tool_calls[0].function.arguments"),
    ([USER, {"role": "assistant", "tool_calls": [{"function": {"name": "lookup", "arguments": "[1]"}}]}, USER],
     "messages[1].tool_calls[0].function.arguments"),
    ([USER, {"role": "assistant", "content": "7"}], "messages[1].role"),
])
def test_malformed_messages_are_refused_naming_the_message(messages, param):
    error = refused(parse_chat_request, {"messages": messages})
    assert (error.param, error.code) == (param, None)


@pytest.mark.parametrize("tools, param, code", [
    ("lookup", "tools", None), ([{"type": "function", "function": {"parameters": {}}}], "tools[0]", None),
    ([{"type": "retrieval"}], "tools[0]", None), ([TOOL, "lookup"], "tools[1]", None),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
     "tools[0].function.parameters", "invalid_tool_schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"required": "x"}}}],
     "tools[0].function.parameters", "invalid_tool_schema"),
])
def test_malformed_tools_are_refused(tools, param, code):
    error = refused(parse_chat_request, {"messages": [USER], "tools": tools})
    assert (error.param, error.code) == (param, code)


@pytest.mark.parametrize("body", [[USER], "secret?", None, 3])
def test_a_body_that_is_no_object_is_refused(body):
    assert refused(parse_chat_request, body).param is None
    assert refused(parse_completion_request, body).param is None


def test_what_clients_send_is_read_as_the_chat_template_reads_it():
    request = chat(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "input_text", "text": "brief."}]},
        USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": 7}'}},
            {"id": "call_2", "type": "function", "function": {"name": "lookup", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "7"}], "name": "lookup"}],
        tools=[TOOL], tool_choice="auto", temperature=1.0, top_p=1, top_k=0, presence_penalty=0, logit_bias={},
        n=1, response_format={"type": "text"}, top_logprobs=0, max_tokens=9, max_completion_tokens=5, stop="\n",
        logprobs=True, stream=True, stream_options={"include_usage": True}, user="u", metadata={"a": "b"},
        parallel_tool_calls=True, seed=3, store=False)
    assert request.messages == [
        {"role": "system", "content": "Be brief."}, USER,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": {"key": 7}}},
            {"id": "call_2", "type": "function", "function": {"name": "lookup", "arguments": {}}}]},
        {"role": "tool", "content": "7", "tool_call_id": "call_1", "name": "lookup"}]
    assert request.tools == [TOOL] and request.use_tools
    options = request.options
    assert (options.max_tokens, options.stop, options.logprobs, options.stream, options.include_usage) == \
        (5, ["\n"], True, True, True)


def test_defaults_and_tool_choice_none():
    request = chat(tools=[TOOL], tool_choice="none")
    assert not request.use_tools and request.tools == [TOOL]
    options = chat().options
    assert (options.max_tokens, options.stop, options.logprobs, options.stream, options.include_usage) == \
        (None, [], False, False, False)
    assert chat(tools=[]).tools is None and not chat(tools=[]).use_tools
    no_parameters = chat(tools=[{"type": "function", "function": {"name": "f"}}]).tools
    assert no_parameters == [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}}}}]


@pytest.mark.parametrize("prompt, expected", [
    ("secret?", "secret?"), (["secret?"], "secret?"), ([4, 9, 26], [4, 9, 26]), ([[4, 9]], [4, 9]),
])
def test_a_completions_prompt_is_one_string_or_one_list_of_ids(prompt, expected):
    request = parse_completion_request({"prompt": prompt, "max_tokens": 3, "logprobs": 0, "echo": False}, RUN)
    assert request.prompt == expected and request.options.max_tokens == 3
    assert request.options.logprobs  # logprobs=0: the sampled tokens' log-probs, no alternatives


@pytest.mark.parametrize("body, param, code", [
    ({}, "prompt", None), ({"prompt": ""}, "prompt", None), ({"prompt": ["a", "b"]}, "prompt", None),
    ({"prompt": []}, "prompt", None), ({"prompt": [4, -1]}, "prompt", None), ({"prompt": [True]}, "prompt", None),
    ({"prompt": [[]]}, "prompt", None), ({"prompt": 7}, "prompt", None),
    ({"prompt": "a", "echo": True}, "echo", "unsupported_parameter"),
    ({"prompt": "a", "best_of": 2}, "best_of", "unsupported_parameter"),
    ({"prompt": "a", "suffix": "b"}, "suffix", "unsupported_parameter"),
    ({"prompt": "a", "logprobs": 5}, "logprobs", None), ({"prompt": "a", "temperature": 0}, "temperature",
                                                          "unsupported_value"),
])
def test_bad_completions_requests_are_refused(body, param, code):
    error = refused(parse_completion_request, body)
    assert (error.param, error.code) == (param, code)
    assert parse_completion_request({"prompt": "a", "logprobs": False}, RUN).options.logprobs is False


RESPONSE = chat_completion("chatcmpl-1", "policy", {
    "role": "assistant", "content": "7", "reasoning_content": "hm",
    "tool_calls": [{"id": "call_0_0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
    "tool_calls", {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    [{"token": "7", "logprob": -0.5, "bytes": [55], "top_logprobs": []}])


def test_a_chat_completion_streams_as_openais_chunks():
    chunks = chat_chunks(RESPONSE, include_usage=True)
    assert {(c["id"], c["object"], c["created"], c["model"]) for c in chunks} == \
        {("chatcmpl-1", "chat.completion.chunk", RESPONSE["created"], "policy")}
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [
        {"role": "assistant", "content": ""}, {"reasoning_content": "hm"}, {"content": "7"},
        {"tool_calls": [{"index": 0, "id": "call_0_0", "type": "function",
                         "function": {"name": "lookup", "arguments": "{}"}}]}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, None, "tool_calls"]
    assert [c["choices"][0]["logprobs"] for c in chunks[:-1]] == [None, None, RESPONSE["choices"][0]["logprobs"],
                                                                   None, None]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 2,
                                                                   "total_tokens": 7}
    assert len(chat_chunks(RESPONSE, include_usage=False)) == len(chunks) - 1


def test_a_streamed_call_without_content_carries_its_logprobs_with_the_finish_reason():
    message = {"role": "assistant", "content": None, "tool_calls": RESPONSE["choices"][0]["message"]["tool_calls"]}
    response = chat_completion("c", "policy", message, "tool_calls", RESPONSE["usage"],
                               [{"token": "x", "logprob": -1.0, "bytes": [120], "top_logprobs": []}])
    chunks = chat_chunks(response, include_usage=False)
    assert [bool(c["choices"][0]["logprobs"]) for c in chunks] == [False, False, True]
    assert chunks[-1]["choices"][0]["logprobs"] == {"content": [{"token": "x", "logprob": -1.0, "bytes": [120],
                                                                 "top_logprobs": []}]}


def test_a_text_completion_streams_its_text_then_its_finish_reason():
    response = text_completion("cmpl-1", "policy", "7?", "length", RESPONSE["usage"], ["7", "?"], [-0.5, -1.5])
    first, last, usage = text_chunks(response, include_usage=True)
    assert first["choices"][0] == {"index": 0, "text": "7?", "finish_reason": None, "logprobs": {
        "tokens": ["7", "?"], "token_logprobs": [-0.5, -1.5], "top_logprobs": None, "text_offset": None}}
    assert last["choices"][0] == {"index": 0, "text": "", "finish_reason": "length", "logprobs": None}
    assert "usage" not in first and "usage" not in last
    assert usage["choices"] == [] and usage["usage"] == RESPONSE["usage"]


def test_server_sent_events():
    text = server_sent_events([{"a": 1}, {"b": [2]}])
    assert text == 'data: {"a": 1}\n\ndata: {"b": [2]}\n\ndata: [DONE]\n\n'
    assert [json.loads(line[6:]) for line in text.split("\n\n")[:2]] == [{"a": 1}, {"b": [2]}]
