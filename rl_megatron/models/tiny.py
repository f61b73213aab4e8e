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
from transformers import (AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen3MoeConfig)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

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


# Each family's tiny model: the demo's width (64, 2 heads of 32) with the family's own features, 4 routed experts
# (top-2) for MoE families. tests/helpers/parity.py builds them with every weight random;
# configs/models/tiny-<name>-digits holds the configs of those the demo models do not cover (`--family NAME`).
#
# Multi-head latent attention at the sizes vLLM's CPU kernel decodes (kv_lora_rank + qk_rope_head_dim = 512 + 64);
# one dense layer first and shared experts. DeepSeek-V3: sigmoid scores with the expert bias, 2 groups of which each
# token may use 1 (2 = top-k / topk_group experts per group, as Megatron scores groups), YaRN whose mscale enters
# the softmax scale. V2(-Lite): softmax scores, no renormalisation, q_proj without LoRA.
MLA = dict(num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
           head_dim=64,  # what DeepSeek configs write: the rotary dimensions
           v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
           first_k_dense_replace=1, rms_norm_eps=1e-6)
# The Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): a Gated DeltaNet layer, then a full-attention one (and so on),
# each linear key head shared by two value heads narrower than it (a mix-up of the two widths shows); a quarter of
# each attention head rotates. HYBRID_EXPERTS: 4 routed experts beside a gated shared expert.
HYBRID = dict(full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, partial_rotary_factor=0.25)
HYBRID_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=96)
FAMILY_FIELDS = {
    # Qwen3-MoE: weights renormalised (as Qwen's released models), half-width experts. Mixtral always renormalises,
    # and its experts are as wide as intermediate_size. Qwen2-MoE: not renormalised (its default), a shared expert
    # of its own width with its gate.
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=64),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=96),
    "deepseek_v3": dict(MLA, q_lora_rank=32, n_shared_experts=1, n_group=2, topk_group=1, topk_method="noaux_tc",
                        scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    "deepseek_v2": dict(MLA, q_lora_rank=None, n_shared_experts=2, n_group=1, topk_group=1, topk_method="greedy",
                        norm_topk_prob=False, routed_scaling_factor=1.5,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                      "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
    # GLM-4.5: half of each head rotates, q/k/v biases and per-head q/k norms, sigmoid routing with the expert bias.
    "glm4_moe": dict(partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, n_routed_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-5),
    # gpt-oss: every layer routes over biased experts (their width is intermediate_size); the window (4 positions,
    # shorter than the demo's sequences) on every other layer; YaRN within the demo's few positions; its epsilon.
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=4,
                    rms_norm_eps=1e-5, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                        "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                                        "beta_slow": 1.0, "truncate": False}),
    # Qwen3-Next: HYBRID's layers; Qwen2-MoE's gated shared expert, weights renormalised.
    "qwen3_next": dict(HYBRID, **HYBRID_EXPERTS, norm_topk_prob=True),
    # Qwen3.5: HYBRID's layers over a dense MLP, or (MoE) over Qwen3-Next's experts on every layer.
    "qwen3_5_text": HYBRID,
    "qwen3_5_moe_text": dict(HYBRID, **HYBRID_EXPERTS),
}
# The base fields a family's config class has none of, left out of its config.json as transformers writes it
# (Qwen3.5-MoE: every layer routes, so there is no dense MLP width).
ABSENT_FIELDS = {"qwen3_5_moe_text": ("intermediate_size",)}
# Llama 3.1's rope scaling with a short original context, so that it acts within the demo's few positions.
LLAMA3_ROPE = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}}
# Qwen2.5's long-context YaRN (as its model cards write it), with the demo-sized original context of LLAMA3_ROPE.
QWEN2_5_YARN = {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}
# configs/models/tiny-<name>-digits: (model_type, fields beyond FAMILY_FIELDS)
TINY_FAMILIES = {"llama3": ("llama", LLAMA3_ROPE), "mistral": ("mistral", {"sliding_window": 4}),
                 "qwen2-moe": ("qwen2_moe", {}), "deepseek-v2": ("deepseek_v2", {}),
                 "deepseek-v3": ("deepseek_v3", {}), "glm4-moe": ("glm4_moe", {}), "gpt-oss": ("gpt_oss", {}),
                 "qwen3-next": ("qwen3_next", {}), "qwen3-5": ("qwen3_5_text", {}),
                 "qwen3-5-moe": ("qwen3_5_moe_text", {})}


def family_config(model_type: str, tied: bool = False, layers: int = 2, **extra):
    """A tiny model of `model_type` over the digits vocabulary (64 positions), with FAMILY_FIELDS and `extra`."""
    base = dict(vocab_size=len(DIGITS.tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                tie_word_embeddings=tied, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                dtype="float32")
    config = AutoConfig.for_model(model_type, **{**base, **FAMILY_FIELDS.get(model_type, {}), **extra})
    for field in ABSENT_FIELDS.get(model_type, ()):
        delattr(config, field)
    return config


def write_tiny_model(out_dir: str, with_weights: bool = False, seed: int = 0, vocabulary: Vocabulary = DIGITS,
                     max_positions: int = 512, moe: bool = False, family: str | None = None) -> str:
    """Writes config, generation config and tokenizer (and random weights if asked) to out_dir; `family`: one of
    TINY_FAMILIES instead of the demo's Qwen2 (digits vocabulary)."""
    os.makedirs(out_dir, exist_ok=True)
    if family is not None:
        model_type, extra = TINY_FAMILIES[family]
        config = family_config(model_type, architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]], **extra)
    else:
        config = build_config(vocabulary, max_positions, moe)
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out_dir)
    # The chat template goes into tokenizer_config.json, where Qwen's released folders have it.
    build_tokenizer(vocabulary).save_pretrained(out_dir, save_jinja_files=False)
    if with_weights:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return out_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rl_megatron.models.tiny", description=__doc__.splitlines()[0])
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
    parser.add_argument("--family", choices=sorted(TINY_FAMILIES),
                        help="another family's tiny model (digits vocabulary), as configs/models/tiny-NAME-digits "
                             "holds it")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    variant = {"vocabulary": TEXT, "max_positions": 1024} if args.text else {"vocabulary": TOOLS} if args.tools else {}
    print(write_tiny_model(args.out_dir, with_weights=args.with_weights, seed=args.seed, moe=args.moe,
                           family=args.family, **variant))


if __name__ == "__main__":
    main()
