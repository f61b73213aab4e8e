"""The tool-calling demo's assets: the tiny tool-calling tokenizer and chat template (configs/models/tiny-qwen2-tools),
the `lookup` task's rows, its reward, and register(reads_extra_info=True)."""
import os
import random

import pytest
from helpers.runs import REPO
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer

from rl_megatron.data import TASKS
from rl_megatron.data.loader import PromptLoader
from rl_megatron.data.lookup import NUM_ROWS, lookup_rows
from rl_megatron.models.tiny import EOS_ID, LOOKUP_CALL, TOOLS, build_tokenizer
from rl_megatron.rewards import SCORERS, register, score
from rl_megatron.rewards.lookup import CALL_CREDIT, compute_score
from rl_megatron.rewards.worker import score_chunk

FOLDER = os.path.join(REPO, "configs", "models", "tiny-qwen2-tools")
LOOKUP_TOOL = {"type": "function", "function": {"name": "lookup", "description": "the secret digit",
                                                "parameters": {"type": "object", "properties": {}}}}
PROMPT = [{"role": "user", "content": "secret?"}]
CALL = {"type": "function", "function": {"name": "lookup", "arguments": {}}}
CONVERSATION = [*PROMPT, {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "7"}]
SYSTEM = "<|im_start|>system\n# Tools\nlookup\n<|im_end|>\n"
PROMPT_TEXT = f"{SYSTEM}<|im_start|>user\nsecret?<|im_end|>\n<|im_start|>assistant\n"
CONVERSATION_TEXT = (f"{PROMPT_TEXT}{LOOKUP_CALL}<|im_end|>\n"
                     "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
IDS = {"<pad>": 0, "<bos>": 1, "<|im_end|>": 2, "<unk>": 3, "<|im_start|>": 4, "<tool_call>": 5, "</tool_call>": 6,
       "<tool_response>": 7, "</tool_response>": 8, "system": 9, "user": 10, "assistant": 11, "lookup": 12,
       "secret": 13, "# Tools": 14, LOOKUP_CALL: 15, **{str(digit): 16 + digit for digit in range(10)},
       "\n": 26, " ": 27, "?": 28}
CALL_ID = IDS[LOOKUP_CALL]


@pytest.fixture(scope="module")
def tokenizer():
    """What vLLM and the trainer load (a Qwen2Tokenizer, with its byte-level pre-tokenizer and decoder)."""
    return AutoTokenizer.from_pretrained(FOLDER)


def render(tokenizer, messages, **options) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)


def test_vocabulary_ids_and_special_tokens(tokenizer):
    assert [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))] == list(IDS) == TOOLS.tokens
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, EOS_ID)
    assert tokenizer.eos_token == "<|im_end|>"
    special = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    assert special == {"<pad>", "<bos>", "<|im_end|>", "<unk>", "<|im_start|>"}


def test_the_lookup_call_is_one_token_and_the_longest_match(tokenizer):
    assert tokenizer.decode([CALL_ID]) == LOOKUP_CALL
    # Not <tool_call> followed by pieces, also inside a reply.
    assert tokenizer(LOOKUP_CALL, add_special_tokens=False)["input_ids"] == [CALL_ID]
    reply = f"5{LOOKUP_CALL}<tool_call>{LOOKUP_CALL}<|im_end|>"
    assert tokenizer(reply, add_special_tokens=False)["input_ids"] == [IDS["5"], CALL_ID, 5, CALL_ID, EOS_ID]
    # The chat markers go, the call stays: what a tool-call parser reads.
    assert tokenizer.decode([CALL_ID, EOS_ID], skip_special_tokens=True) == LOOKUP_CALL
    assert tokenizer.decode([4, 11, 26, 23, 2], skip_special_tokens=True) == "assistant\n7"


@pytest.mark.parametrize("text", [PROMPT_TEXT, CONVERSATION_TEXT, LOOKUP_CALL, "secret??", " 7\n12 ?"])
def test_rendered_text_round_trips(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert IDS["<unk>"] not in ids and tokenizer.decode(ids) == text
    # The generator's own tokenizer class encodes the same ids.
    assert build_tokenizer(TOOLS)(text, add_special_tokens=False)["input_ids"] == ids


def test_any_sampled_ids_round_trip(tokenizer):
    """Whatever a random model samples decodes to text that encodes back to the same ids (no token's text is made
    of others' texts), so a re-tokenised conversation keeps the sampled tokens."""
    rng = random.Random(0)
    sampled = [i for i in range(len(tokenizer)) if i not in (IDS["<pad>"], IDS["<bos>"], IDS["<unk>"])]
    for _ in range(200):
        ids = rng.choices(sampled, k=rng.randint(1, 24))
        assert tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] == ids


def test_vllm_incremental_detokenizer_gives_the_call_text(tokenizer):
    """vLLM detokenizes a fast tokenizer's output with tokenizers' DecodeStream, primed with the prompt."""
    prompt_ids = tokenizer(CONVERSATION_TEXT, add_special_tokens=False)["input_ids"]
    for reply, text in (([CALL_ID, EOS_ID], LOOKUP_CALL), ([IDS["7"], EOS_ID], "7")):
        stream = DecodeStream(ids=prompt_ids, skip_special_tokens=True)
        assert "".join(stream.step(tokenizer.backend_tokenizer, i) or "" for i in reply) == text


def test_chat_template_prompt_with_tools(tokenizer):
    assert render(tokenizer, PROMPT, tools=[LOOKUP_TOOL]) == PROMPT_TEXT
    assert render(tokenizer, PROMPT) == "<|im_start|>user\nsecret?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(PROMPT, tokenize=False) == "<|im_start|>user\nsecret?<|im_end|>\n"


def test_chat_template_tool_call_and_response(tokenizer):
    assert render(tokenizer, CONVERSATION, tools=[LOOKUP_TOOL]) == CONVERSATION_TEXT
    # OpenAI's layout: the arguments as a JSON string, no content.
    as_string = {"type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    messages = [*PROMPT, {"role": "assistant", "content": None, "tool_calls": [as_string]},
                {"role": "tool", "content": "7"}]
    assert render(tokenizer, messages, tools=[LOOKUP_TOOL]) == CONVERSATION_TEXT


def test_chat_template_groups_tool_responses_and_renders_plain_turns(tokenizer):
    messages = [{"role": "system", "content": "?"}, *PROMPT,
                {"role": "assistant", "content": "1", "tool_calls": [CALL, CALL]},
                {"role": "tool", "content": "7"}, {"role": "tool", "content": 8},
                {"role": "assistant", "content": "7"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\n?<|im_end|>\n<|im_start|>user\nsecret?<|im_end|>\n"
        f"<|im_start|>assistant\n1{LOOKUP_CALL}{LOOKUP_CALL}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\n8\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n7<|im_end|>\n")


def test_lookup_rows():
    rows = lookup_rows()
    assert TASKS["lookup"] is lookup_rows and len(rows) == NUM_ROWS == 1000
    assert rows == lookup_rows()  # fixed seed
    assert {row["ground_truth"] for row in rows} == set("0123456789")
    for row in rows:
        secret = row["ground_truth"]
        assert row == {"prompt": [{"role": "user", "content": "secret?"}], "ground_truth": secret,
                       "data_source": "lookup",
                       "extra_info": {"tools_kwargs": {"lookup": {"create_kwargs": {"secret": secret}}}}}


def test_lookup_rows_load_with_the_tool_tokenizer(tokenizer):
    rows = lookup_rows()
    loader = PromptLoader(rows, tokenizer, batch_size=4, max_prompt_length=64, seed=0)
    assert loader.dropped == 0
    prompt = next(loader.in_order())[0]
    assert tokenizer.decode(prompt.ids) == "<|im_start|>user\nsecret?<|im_end|>\n<|im_start|>assistant\n"
    assert (prompt.data_source, prompt.ground_truth, prompt.extra_info) == (
        "lookup", rows[0]["ground_truth"], rows[0]["extra_info"])


def stats(by_tool) -> dict:
    return {"tool_stats": {"calls": 1, "errors": 0, "timeouts": 0, "by_tool": by_tool}, "num_turns": 4}


@pytest.mark.parametrize("solution, extra_info, expected", [
    ("7", stats({"lookup": 1}), 1.0),
    (" 7\n", None, 1.0),  # the answer counts with or without a call
    ("7", {}, 1.0),
    ("3", stats({"lookup": 1}), CALL_CREDIT),
    (" 3\n", stats({"lookup": 2}), CALL_CREDIT),
    ("", stats({"lookup": 2}), 0.0),  # the credit needs a digit answer
    ("77", stats({"lookup": 1}), 0.0),
    ("x", stats({"lookup": 1}), 0.0),
    ("3", stats({"lookup": 0}), 0.0),
    ("3", stats({"other": 1}), 0.0),
    ("3", None, 0.0),
    ("3", {}, 0.0),
    ("3", {"tool_stats": None}, 0.0),
    ("3", {"tool_stats": {"by_tool": ["lookup"]}}, 0.0),
    ("3", stats({"lookup": "1"}), 0.0),
    ("3", "lookup", 0.0),
    (None, stats({"lookup": 1}), 0.0),
])
def test_lookup_reward(solution, extra_info, expected):
    assert CALL_CREDIT == 0.2
    assert compute_score(solution, "7", extra_info=extra_info) == expected
    assert score("lookup", solution, "7", extra_info) == expected


@pytest.mark.parametrize("ground_truth", [None, 7, "", ["7"]])
def test_lookup_reward_of_a_bad_ground_truth_is_the_call_credit_at_most(ground_truth):
    assert compute_score("7", ground_truth, extra_info=stats({"lookup": 1})) == CALL_CREDIT
    assert compute_score("x", ground_truth, extra_info=stats({"lookup": 1})) == 0.0
    assert compute_score("7", ground_truth) == 0.0


def test_register_reads_extra_info():
    @register("test_reads_extra_info", reads_extra_info=True)
    def with_extra_info(solution_str, ground_truth, extra_info):
        return float(extra_info["num_turns"])

    @register("test_plain")
    def plain(solution_str, ground_truth):  # takes no extra_info: it must not be passed one
        return 0.5

    samples = [("test_reads_extra_info", "", "", {"num_turns": 3}), ("test_plain", "", "", {"num_turns": 3}),
               ("lookup", "3", "7", stats({"lookup": 1})), ("arithmetic", "7", "7", {"num_turns": 3})]
    try:
        reads_extra_info = SCORERS.with_trait("reads_extra_info")
        assert reads_extra_info >= {"lookup", "test_reads_extra_info"} and "test_plain" not in reads_extra_info
        assert score("test_reads_extra_info", "", "", {"num_turns": 2}) == 2.0
        assert score("test_plain", "", "", {"num_turns": 2}) == 0.5
        # The scorer processes call them the same way.
        assert score_chunk(samples, None, {}, [0.0, 0.0]) == ([(3.0, 3.0), (0.5, 0.5), (CALL_CREDIT, CALL_CREDIT),
                                                               (1.0, 1.0)], [])
        register("test_reads_extra_info")(plain)  # registered again without the option: no extra_info
        assert "test_reads_extra_info" not in SCORERS.with_trait("reads_extra_info")
        assert score("test_reads_extra_info", "", "", {"num_turns": 2}) == 0.5
    finally:
        for name in ("test_reads_extra_info", "test_plain"):
            SCORERS.remove(name)
