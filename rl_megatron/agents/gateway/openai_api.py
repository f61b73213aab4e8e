"""OpenAI's chat and completions API as the gateway speaks it: requests checked into typed values, responses and
stream chunks built from what an episode sampled, errors in OpenAI's shape (`{"error": {...}}` with an HTTP 4xx).

Sampling parameters are the run's: the trainer's log-probs assume rollout.temperature (and top_p, top_k), and the
seeds are the run's (a resumed run replays its episodes). A request may repeat the run's values or leave them out;
another value is refused, naming the key, rather than silently sampling from another distribution than the one
trained. Parameters that would constrain or bias decoding (logit_bias, penalties, a required or named tool choice, a
JSON response format) are refused for the same reason; bookkeeping keys clients send (user, metadata, store,
parallel_tool_calls, seed, service_tier, ...) are accepted and ignored.
"""
from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import jsonschema

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4  # OpenAI's limit


class ApiError(Exception):
    """An error the client gets back as OpenAI writes them: HTTP `status` with {"error": {message, type, param,
    code}}."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class RunSampling:
    """The run's sampling settings (rollout.temperature, top_p, top_k, max_tokens) that requests must match."""
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int


@dataclass
class GenerationOptions:
    """What a request asks of one generation, beside its prompt."""
    max_tokens: int | None = None  # None: rollout.max_tokens
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False


@dataclass
class ChatRequest:
    messages: list[dict]  # as the chat template reads them: string contents, tool-call arguments as objects
    tools: list[dict] | None
    use_tools: bool  # tool_choice is not "none": the turn's calls are returned as tool_calls
    options: GenerationOptions


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    options: GenerationOptions


def parse_chat_request(body: Any, run: RunSampling) -> ChatRequest:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty array of messages", "messages")
    checked = [_message(m, i) for i, m in enumerate(messages)]
    if checked[-1]["role"] == "assistant":
        raise ApiError("the last message is the assistant's: the gateway does not continue an assistant message "
                       "(end 'messages' with a user or tool message)", f"messages[{len(checked) - 1}].role")
    tools = _tools(body.get("tools"))
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in ("auto", "none", None):
        raise ApiError("tool_choice must be 'auto' or 'none': a required or named tool would constrain decoding, "
                       "and the trainer's log-probs assume the policy sampled freely", "tool_choice", "unsupported_value")
    return ChatRequest(checked, tools, tools is not None and tool_choice != "none",
                       _options(body, run, "max_completion_tokens"))


def parse_completion_request(body: Any, run: RunSampling) -> CompletionRequest:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    valid = isinstance(prompt, str) and prompt or (isinstance(prompt, list) and prompt
                                                  and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                          for t in prompt))
    if not valid:
        raise ApiError("'prompt' must be one non-empty string or one array of token ids (an episode is one "
                       "conversation: send one prompt per request)", "prompt")
    for key, accepted in (("echo", (None, False)), ("best_of", (None, 1)), ("suffix", (None, ""))):
        if body.get(key) not in accepted:  # each its own values: echo=True equals best_of=1
            raise ApiError(f"'{key}' is not supported by the gateway", key, "unsupported_parameter")
    return CompletionRequest(prompt, _options(body, run, None))


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def _options(body: dict, run: RunSampling, other_max_key: str | None) -> GenerationOptions:
    for key, value in (("temperature", run.temperature), ("top_p", run.top_p), ("top_k", run.top_k)):
        given = body.get(key)
        if given is not None and not (key == "top_k" and given in (-1, 0) and run.top_k == -1) and given != value:
            raise ApiError(f"{key}={given}: this run samples at {key}={value} (rollout.{key}), which the trainer's "
                           f"log-probs assume; leave '{key}' out or send {value}", key, "unsupported_value")
    for key, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        if body.get(key) not in (None, neutral):
            raise ApiError(f"'{key}' would change the policy's distribution, which the trainer's log-probs assume "
                           "unchanged; leave it out", key, "unsupported_parameter")
    if body.get("logit_bias"):
        raise ApiError("'logit_bias' would change the policy's distribution; leave it out", "logit_bias",
                       "unsupported_parameter")
    if body.get("n") not in (None, 1):
        raise ApiError("n must be 1: an episode samples one answer per call (GRPO's group is rollout.n episodes)", "n",
                       "unsupported_value")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise ApiError("response_format other than text would constrain decoding; leave it out", "response_format",
                       "unsupported_parameter")
    if body.get("top_logprobs") not in (None, 0):
        raise ApiError("top_logprobs is not supported: the engine returns each sampled token's log-prob only "
                       "(logprobs: true)", "top_logprobs", "unsupported_parameter")
    max_tokens = body.get("max_tokens")
    key = "max_tokens"
    if other_max_key and body.get(other_max_key) is not None:
        max_tokens, key = body[other_max_key], other_max_key
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ApiError(f"'{key}' must be a positive integer", key)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in stop)):
        raise ApiError(f"'stop' must be a string or an array of at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    logprobs = body.get("logprobs")
    if logprobs not in (None, True, False) and not (other_max_key is None and logprobs in (0, 1)):
        raise ApiError("'logprobs' must be a boolean", "logprobs")
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise ApiError("'stream' must be a boolean", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError("'stream_options' must be an object", "stream_options")
    # /v1/completions' logprobs is a count of top tokens: 0 still asks for each sampled token's (as OpenAI and vLLM)
    logprobs = bool(logprobs) or (other_max_key is None and logprobs == 0 and not isinstance(logprobs, bool))
    return GenerationOptions(max_tokens, stop, logprobs, bool(stream), bool(stream_options.get("include_usage")))


def _message(message: Any, index: int) -> dict:
    """A message as the chat template reads it."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise ApiError(f"{where} must be an object whose 'role' is one of {', '.join(ROLES)}", f"{where}.role")
    role = message["role"]
    checked = {"role": "system" if role == "developer" else role, "content": _text(message.get("content"), where)}
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise ApiError(f"{where} is a tool message without the 'tool_call_id' of the call it answers",
                           f"{where}.tool_call_id")
        checked["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        checked["name"] = message["name"]
    if role == "assistant" and message.get("tool_calls"):
        checked["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{i}]")
                                 for i, call in enumerate(_list(message["tool_calls"], f"{where}.tool_calls"))]
    return checked


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(part["text"] for part in content)
    raise ApiError(f"{where}.content must be a string or an array of text parts (the policy reads text only)",
                   f"{where}.content")


def _tool_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}", where)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise ApiError(f"{where}.function.arguments is not valid JSON", f"{where}.function.arguments") from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ApiError(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise ApiError(f"{where} must be an array", where)
    return value


def _tools(tools: Any) -> list[dict] | None:
    if tools is None or tools == []:
        return None
    checked = []
    for i, tool in enumerate(_list(tools, "tools")):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" \
            else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ApiError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}",
                           where)
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        problem = _schema_problem(json.dumps(parameters, sort_keys=True))
        if problem is not None:
            raise ApiError(f"{where}.function.parameters is not a valid JSON schema: {problem}",
                           f"{where}.function.parameters", "invalid_tool_schema")
        checked.append({"type": "function", "function": dict(function, parameters=parameters)})
    return checked


@functools.lru_cache(maxsize=256)
def _schema_problem(parameters: str) -> str | None:
    """Why a tool's parameters (as JSON) are not a JSON schema, None when they are; cached: a harness sends the same
    tools with every call, and checking a schema costs a millisecond or more."""
    schema = json.loads(parameters)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except (jsonschema.SchemaError, TypeError, AttributeError) as err:
        return getattr(err, "message", str(err))
    return None


# -- responses -------------------------------------------------------------------------------------------------------

def openai_tool_calls(calls: list[tuple[str, str, dict]]) -> list[dict]:
    """(id, name, arguments) as an assistant message's tool_calls (arguments a JSON string, as OpenAI sends them)."""
    return [{"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            for call_id, name, arguments in calls]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_logprobs(tokens: list[str], logprobs: list[float]) -> list[dict]:
    return [{"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
            for token, logprob in zip(tokens, logprobs)]


def chat_completion(response_id: str, model: str, message: dict, finish_reason: str, used: dict,
                    logprobs: list[dict] | None) -> dict:
    return {"id": response_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                         "logprobs": None if logprobs is None else {"content": logprobs}}],
            "usage": used}


def chat_chunks(response: dict, include_usage: bool) -> list[dict]:
    """A chat completion as the stream of chunks OpenAI sends: the role, the content, each tool call, the finish
    reason (then the usage, when asked)."""
    choice = response["choices"][0]
    message = choice["message"]
    head = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}

    def chunk(delta: dict, finish_reason: str | None = None, logprobs=None) -> dict:
        return dict(head, choices=[{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                    "logprobs": logprobs}])

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("reasoning_content"):
        chunks.append(chunk({"reasoning_content": message["reasoning_content"]}))
    logprobs = choice["logprobs"]  # every sampled token's: with the content, else with the finish reason
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}, logprobs=logprobs))
        logprobs = None
    for index, call in enumerate(message.get("tool_calls") or []):
        chunks.append(chunk({"tool_calls": [dict(call, index=index)]}))
    chunks.append(chunk({}, choice["finish_reason"], logprobs))
    if include_usage:
        chunks.append(dict(head, choices=[], usage=response["usage"]))
    return chunks


def text_completion(response_id: str, model: str, text: str, finish_reason: str, used: dict,
                    tokens: list[str] | None, logprobs: list[float] | None) -> dict:
    return {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason,
                         "logprobs": None if tokens is None else {"tokens": tokens, "token_logprobs": logprobs,
                                                                  "top_logprobs": None, "text_offset": None}}],
            "usage": used}


def text_chunks(response: dict, include_usage: bool) -> list[dict]:
    choice = response["choices"][0]
    chunks = [dict(response, choices=[dict(choice, finish_reason=None)]),
              dict(response, choices=[dict(choice, text="", logprobs=None)])]
    for c in chunks:
        c.pop("usage", None)
    if include_usage:
        chunks.append(dict(response, choices=[]))
    return chunks


def models_list(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "rl_megatron"}]}


def server_sent_events(chunks: list[dict]) -> str:
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
