"""The demo model: a 2-layer Qwen2 with a character-level tokenizer over digits, '+', '-', '=', ' '; with --moe a
2-layer Qwen3-MoE of the same width (4 experts, top-2) for the MoE configs (configs/moe/).

Everything is built locally, so the demo and the tests never download a model. Usage:
    python -m rl_megatron.models.tiny OUT_DIR [--with-weights] [--seed N] [--moe]
"""
import argparse
import os

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen3MoeConfig)

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = "0123456789+-= "
# Printable ASCII and the newline: a tokenizer for real task prompts (countdown, GSM8K) on the tiny model.
TEXT_CHARACTERS = "".join(chr(code) for code in range(32, 127)) + "\n"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def build_tokenizer(characters: str = CHARACTERS) -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + list(characters))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.add_special_tokens(SPECIAL_TOKENS)
    # AutoTokenizer (and so vLLM) loads any qwen2 folder as Qwen2Tokenizer, whose byte-level
    # pre-tokenizer turns " " into "Ġ" (and a newline into "Ċ"), which are not in the vocab. Added tokens are
    # matched before any pre-tokenizer, so they keep their ids under either class.
    backend.add_tokens([AddedToken(c, normalized=False) for c in " \n" if c in characters])
    # Every character is its own token; Fuse joins them back without separators.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS_ID)]
    )
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def build_config(characters: str = CHARACTERS, max_positions: int = 512, moe: bool = False):
    shape = dict(
        vocab_size=len(SPECIAL_TOKENS) + len(characters),
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


def write_tiny_model(out_dir: str, with_weights: bool = False, seed: int = 0, characters: str = CHARACTERS,
                     max_positions: int = 512, moe: bool = False) -> str:
    """Writes config, generation config and tokenizer (and random weights if asked) to out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    config = build_config(characters, max_positions, moe)
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out_dir)
    build_tokenizer(characters).save_pretrained(out_dir)
    if with_weights:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder to write the model files into (created if missing)")
    parser.add_argument("--with-weights", action="store_true", help="also write random safetensors weights")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--text", action="store_true",
                        help="a tokenizer over printable ASCII and newlines, and 1024 positions: real task prompts "
                             "(countdown, GSM8K) instead of digits")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE (4 experts, top-2) instead of the Qwen2")
    args = parser.parse_args()
    text = {"characters": TEXT_CHARACTERS, "max_positions": 1024} if args.text else {}
    print(write_tiny_model(args.out_dir, with_weights=args.with_weights, seed=args.seed, moe=args.moe, **text))


if __name__ == "__main__":
    main()
