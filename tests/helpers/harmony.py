"""gpt-oss's chat template (tests/data/gpt_oss_chat_template.jinja, the published template as is) and two tokenizers
with its special tokens, built locally: one token per character (rl_megatron.models.tiny's builder), and a small
byte-level BPE whose pre-tokenizer is o200k's, the gpt-oss tokenizer's, which joins a quote to the word after it (so
the tokens of a JSON-quoted tool reply depend on encoding the quote and the reply together)."""
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rl_megatron.models.tiny import TEXT, Vocabulary, build_tokenizer

TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "data" / "gpt_oss_chat_template.jinja"
TEMPLATE = TEMPLATE_PATH.read_text()
# gpt-oss's special tokens that the template and the harmony format use; pad, bos, eos, unk first (tiny's order).
SPECIAL = ("<|endoftext|>", "<|startoftext|>", "<|return|>", "<unk>", "<|start|>", "<|end|>", "<|message|>",
           "<|channel|>", "<|constrain|>", "<|call|>")
DATE = "2025-08-05"  # the template writes today's date into its system message: fixed, for renderings to compare
# The gpt-oss tokenizer's pre-tokenizer pattern (tiktoken's o200k): a leading non-letter joins the word after it.
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
LOOKUP_SCHEMA = {"type": "function", "function": {
    "name": "lookup", "description": "Look up the secret digit of this question.",
    "parameters": {"type": "object", "properties": {}, "required": []}}}


def char_tokenizer(template: str = TEMPLATE) -> PreTrainedTokenizerFast:
    return build_tokenizer(Vocabulary(TEXT.characters, special=SPECIAL, chat_template=template))


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few harmony conversations, quoted words among them."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    sentences = ['"seven is the secret" said the tool', "the secret digit is seven", "I should look it up",
                 '{"digit": 7, "again": true}', "What is the secret digit? Look it up."]
    corpus = [render(char_tokenizer(), [{"role": "user", "content": s}], [LOOKUP_SCHEMA], add_generation_prompt=True)
              for s in sentences] * 20 + sentences * 50
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=SPECIAL[0], bos_token=SPECIAL[1],
                                        eos_token=SPECIAL[2])
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None, **options) -> str:
    """The template's text for `messages`, on the fixed DATE."""
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, strftime_now=lambda _: DATE,
                                         **options)


def encode(tokenizer, text: str) -> list[int]:
    """`text`'s tokens as a rendered conversation is encoded (its markers as special tokens, no BOS added)."""
    return tokenizer.encode(text, add_special_tokens=False)


def stop_ids(tokenizer) -> list[int]:
    """gpt-oss's generation_config.json eos_token_id: <|return|>, <|endoftext|>, <|call|>."""
    return tokenizer.convert_tokens_to_ids(["<|return|>", "<|endoftext|>", "<|call|>"])


def call_message(name: str, arguments: dict, thinking: str | None = None) -> dict:
    """An assistant turn that calls `name`, in the template's fields (its analysis in `thinking`)."""
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": arguments}}]}
    return message | ({"thinking": thinking} if thinking else {})
