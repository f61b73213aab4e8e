"""The demo models: a 2-layer Qwen2 with a character-level tokenizer over digits, '+', '-', '=', ' '; with --moe a
2-layer Qwen3-MoE of the same width (4 experts, top-2) for the MoE configs (configs/moe/); with --tools the
tool-calling demo's tokenizer and chat template (configs/models/tiny-qwen2-tools, the `lookup` task).

Everything is built locally, so the demo and the tests never download a model. Usage:
    python -m rl_megatron.models.tiny OUT_DIR [--with-weights] [--seed N] [--moe] [--text | --tools]

The tool-calling tokenizer (TOOLS, 29 tokens) comes with a compact copy of Qwen2.5's Hermes tool format
(TOOL_CHAT_TEMPLATE). A random-initialised model samples nearly uniformly over its vocabulary, so every extra token
slows its exploration, and it would never assemble a well-formed JSON call from pieces. So the whole lookup call,
exactly as the template writes it (LOOKUP_CALL), is ONE token: the model emits a complete call by chance (about one
first token in 29), and tokenizers matches the longest added token, so the call's text encodes back to that token.
The markup words (`<tool_call>`, `system`, `# Tools`, ...) and the call are non-special added tokens, which
decode(skip_special_tokens=True) keeps for the tool-call parser; <|im_start|> and <|im_end|> (the end of sequence:
generation stops on it) are special.
"""
import argparse
import os
from dataclasses import dataclass

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen3MoeConfig)

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer's tokens in id order: the special ones (pad, bos, eos, unk at PAD_ID..UNK_ID, then any others),
    whole words (added tokens: matched before any pre-tokenizer, the longest first), then single characters; and
    its chat template."""
    characters: str
    special: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
    words: tuple[str, ...] = ()
    chat_template: str | None = None

    @property
    def tokens(self) -> list[str]:
        return [*self.special, *self.words, *self.characters]


DIGITS = Vocabulary("0123456789+-= ")
# Printable ASCII and the newline: a tokenizer for real task prompts (countdown, GSM8K) on the tiny model.
TEXT = Vocabulary("".join(chr(code) for code in range(32, 127)) + "\n")

LOOKUP_CALL = '<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>'
# Qwen2.5's tool format, compact: the system turn lists only the tools' names; a tool call follows the assistant's
# content without Qwen's newline between them, so that rendering a parsed reply gives back the model's own tokens.
TOOL_CHAT_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n# Tools\n' }}
    {%- for tool in tools %}
        {{- tool.function.name ~ '\n' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {#- Consecutive tool responses share one user turn, as in Qwen's template. #}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' ~ message.content ~ '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' ~ message.role ~ '\n' ~ (message.content or '') }}
        {%- for call in message.tool_calls or [] %}
            {#- OpenAI's layout carries the arguments as a JSON string; a mapping is written as Qwen does. #}
            {%- set arguments = call.function.arguments %}
            {{- '<tool_call>\n{"name": "' ~ call.function.name ~ '", "arguments": ' }}
            {{- (arguments if arguments is string else arguments | tojson) ~ '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""".strip()
TOOLS = Vocabulary(
    "0123456789\n ?",
    special=("<pad>", "<bos>", "<|im_end|>", "<unk>", "<|im_start|>"),
    words=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "system", "user", "assistant",
           "lookup", "secret", "# Tools", LOOKUP_CALL),
    chat_template=TOOL_CHAT_TEMPLATE,
)


def build_tokenizer(vocabulary: Vocabulary = DIGITS) -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(vocabulary.tokens)}
    special = vocabulary.special
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=special[UNK_ID]))
    backend.add_special_tokens(list(special))
    # AutoTokenizer (and so vLLM) loads any qwen2 folder as Qwen2Tokenizer, whose byte-level
    # pre-tokenizer turns " " into "Ġ" (and a newline into "Ċ"), which are not in the vocab. Added tokens are
    # matched before any pre-tokenizer, so they keep their ids under either class.
    backend.add_tokens([AddedToken(token, normalized=False)
                        for token in [*vocabulary.words, *(c for c in " \n" if c in vocabulary.characters)]])
    # Every character is its own token; Fuse joins them back without separators.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(
        single=f"{special[BOS_ID]} $A", special_tokens=[(special[BOS_ID], BOS_ID)]
    )
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=special[BOS_ID], eos_token=special[EOS_ID], pad_token=special[PAD_ID],
        unk_token=special[UNK_ID]
    )
    # Set here, not in the constructor, which would write them (empty) into the digits folders' tokenizer_config.json.
    tokenizer.extra_special_tokens = list(special[UNK_ID + 1:])
    tokenizer.chat_template = vocabulary.chat_template
    return tokenizer


def build_config(vocabulary: Vocabulary = DIGITS, max_positions: int = 512, moe: bool = False):
    shape = dict(
        vocab_size=len(vocabulary.tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        # vLLM's CPU attention needs head_dim >= 32; two KV heads let TP=2 split them.
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )
    if moe:  # experts of half the dense width; their weights renormalised over the top-k, as Qwen's released models
        return Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=64, norm_topk_prob=True, **shape)
    return Qwen2Config(architectures=["Qwen2ForCausalLM"], **shape)


def write_tiny_model(out_dir: str, with_weights: bool = False, seed: int = 0, vocabulary: Vocabulary = DIGITS,
                     max_positions: int = 512, moe: bool = False) -> str:
    """Writes config, generation config and tokenizer (and random weights if asked) to out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    config = build_config(vocabulary, max_positions, moe)
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out_dir)
    # The chat template goes into tokenizer_config.json, where Qwen's released folders have it.
    build_tokenizer(vocabulary).save_pretrained(out_dir, save_jinja_files=False)
    if with_weights:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder to write the model files into (created if missing)")
    parser.add_argument("--with-weights", action="store_true", help="also write random safetensors weights")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    vocabulary = parser.add_mutually_exclusive_group()
    vocabulary.add_argument("--text", action="store_true",
                            help="a tokenizer over printable ASCII and newlines, and 1024 positions: real task "
                                 "prompts (countdown, GSM8K) instead of digits")
    vocabulary.add_argument("--tools", action="store_true",
                            help="the tool-calling demo's tokenizer and chat template (Hermes tool calls, the lookup "
                                 "task) instead of digits")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE (4 experts, top-2) instead of the Qwen2")
    args = parser.parse_args()
    variant = {"vocabulary": TEXT, "max_positions": 1024} if args.text else {"vocabulary": TOOLS} if args.tools else {}
    print(write_tiny_model(args.out_dir, with_weights=args.with_weights, seed=args.seed, moe=args.moe, **variant))


if __name__ == "__main__":
    main()
