"""Token in, token out in gpt-oss's harmony format: the tokens spliced in after a model turn that called tools (each
reply, then the generation prompt), as the chat template renders them.

ChatDeltas' fixed conversation (a user message, then an assistant answer) cannot be followed by a tool message in
gpt-oss's template: the template writes a tool message as from `functions.{the last call's name}` and refuses one
after anything but a call. So each reply is rendered after an assistant turn that calls its function, and the
text after that call's end (<|call|>) is taken; gpt-oss's template gives

    <|start|>functions.lookup to=assistant<|channel|>commentary<|message|>"7"<|end|>   (the content as a JSON string)

then the generation prompt, `<|start|>assistant`. Several replies after one turn (only when a turn goes on past a
call) follow each other as harmony messages of their own, each named after its function: a sequence harmony allows
and the template cannot write in one conversation (it names every reply after the last call).

A reply's content is text from outside the model: special-token strings in it stay characters (as in ChatDeltas).
Where the template writes text around the content inside the message (the JSON string's quotes), that text and the
content are encoded as one piece, as the whole conversation's text would be: a tokenizer whose pre-tokenizer joins
a quote to the word after it (o200k's) then gives the template's own tokens.
"""
from __future__ import annotations

import json
from typing import Callable

from jinja2.exceptions import TemplateError

from rl_megatron.tools.harmony import CALL, END, writes_harmony

_ANCHOR = "rl_megatron_anchor"  # an argument of the anchoring call, to find where the template writes that call


class HarmonyDeltas:
    def __init__(self, tokenizer, stop_ids: list[int]):
        """`stop_ids`: the tokens generation stops at; they must hold the marker the template ends a call with
        (<|call|>), so that each call's reply follows it."""
        if not writes_harmony(getattr(tokenizer, "chat_template", None)):
            raise ValueError("rollout.multi_turn.format=harmony needs gpt-oss's chat template (harmony messages, "
                             "<|channel|>), and model.path's tokenizer has another or none: use format=auto")
        self.tokenizer = tokenizer
        reply = [{"role": "tool", "name": _ANCHOR, "content": "?"}]
        try:
            without, with_prompt = (self._rendered(reply, prompt) for prompt in (False, True))
        except TemplateError as err:
            raise ValueError(f"the chat template cannot write an assistant's tool call and its reply ({err}): "
                             "rollout.multi_turn.format=harmony needs gpt-oss's template") from None
        anchor = without.find(json.dumps(_ANCHOR))
        ends = sorted((without.find(marker, anchor), marker) for marker in (CALL, END) if marker in without[anchor:])
        if anchor < 0 or not ends or not with_prompt.startswith(without):
            raise ValueError("the chat template does not write an assistant's tool call as a harmony message (to="
                             "functions.NAME ... <|call|>): rollout.multi_turn.format=harmony needs gpt-oss's template")
        self.call_end = ends[0][1]  # the marker the template ends a call with: <|call|> (<|end|> in its first release)
        self.generation_prompt = with_prompt[len(without):]  # "<|start|>assistant"
        self.call_end_ids = self._encode(self.call_end)
        if len(self.call_end_ids) != 1 or self.call_end_ids[0] not in stop_ids:
            raise ValueError(f"the chat template ends a call with {self.call_end}, which is not one of the tokens "
                             f"generation stops at ({[tokenizer.decode([i]) for i in stop_ids]}): a call's reply must "
                             "follow it; add its id to model.path's generation_config.json eos_token_id")
        self._special = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
        self._writing: Callable[[str], str] | None = None  # how the template writes a tool message's content

    def after_turn(self, messages: list[dict], closing: str | None = None) -> list[int]:
        """The tokens that follow a model turn: `closing` (HarmonyTurn.closing: the marker that ends the turn's
        last message, when the turn stopped inside it), `messages` (tool replies, each with the `name` of the
        function it answers), and the generation prompt."""
        holder = "\ue000"  # a private-use character: in no real text
        ids = self._encode(closing) if closing else []
        for message in messages:
            name = message.get("name")
            if message["role"] == "tool" and not name:
                raise ValueError("a harmony tool message needs the 'name' of the function it answers (the template "
                                 "writes it as from functions.NAME): add it to the message")
            before, found, after = self._after_call(name or _ANCHOR, dict(message, content=holder)).partition(holder)
            if not found:
                raise ValueError("the chat template rewrites a tool message's content: a multi-turn agent loop needs "
                                 "a template that writes message contents as given or as a JSON string")
            # The markup's text next to the content (a JSON string's quotes) is encoded with it, as in the whole text.
            head, near_before = self._split(before, last=True)
            near_after, tail = self._split(after, last=False)
            content = self._as_written(message["content"])
            ids += self._encode(head) + self._encode(near_before + content + near_after, split_special_tokens=True)
            ids += self._encode(tail)
        return ids + self._encode(self.generation_prompt)

    def _rendered(self, messages: list[dict], generation_prompt: bool, name: str = _ANCHOR) -> str:
        """The template's text for a user's question, an assistant turn that calls `name`, then `messages`."""
        call = {"name": name, "arguments": {_ANCHOR: 0}}
        conversation = [{"role": "user", "content": "?"},
                        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}]
        return self.tokenizer.apply_chat_template(conversation + messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _after_call(self, name: str, message: dict) -> str:
        """The template's text for `message` after an assistant turn that calls `name`, from the end of that call."""
        text = self._rendered([message], generation_prompt=False, name=name)
        return text[text.index(self.call_end, text.rfind(json.dumps(_ANCHOR))) + len(self.call_end):]

    def _split(self, text: str, last: bool) -> tuple[str, str]:
        """`text` cut at the end of its last special-token string (last) or at the start of its first."""
        if last:
            at = max((text.rfind(s) + len(s) for s in self._special if s in text), default=0)
        else:
            at = min((text.find(s) for s in self._special if s in text), default=len(text))
        return text[:at], text[at:]

    def _encode(self, text: str, **options) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, **options) if text else []

    def _as_written(self, content: str) -> str:
        """A tool message's content as the template writes it: as given, or as a JSON string (gpt-oss's `tojson`;
        its quotes are the markup's), found once from a probe."""
        if self._writing is None:
            probe = ' \ue002 "\n'
            text = self._after_call(_ANCHOR, {"role": "tool", "name": _ANCHOR, "content": probe})
            ways = [(probe, _as_given), (json.dumps(probe, ensure_ascii=False)[1:-1], _json_string)]
            found = [way for written, way in ways if written in text]
            if not found:
                raise ValueError("the chat template rewrites a tool message's content (beyond writing it as a JSON "
                                 "string): a multi-turn agent loop needs a template that writes contents as given")
            self._writing = found[0]
        return self._writing(content)


def _as_given(content: str) -> str:
    return content


def _json_string(content: str) -> str:
    """`content` as a JSON string's inside (transformers' `tojson` keeps non-ASCII characters as they are)."""
    return json.dumps(content, ensure_ascii=False)[1:-1]
