"""The tokenizer of a model folder: loaded once per process, and checked before anything starts.

transformers builds a tokenizer from whatever a folder holds: from one without tokenizer files it quietly builds an
EMPTY tokenizer (one token; every prompt encodes to []), and a run would start and train on nothing. The pre-flight
check (`rl_megatron.preflight`) and the trainer both take model.path's tokenizer from `checked_tokenizer`,
which loads it once (the trainer gets the tokenizer the check loaded) and checks that:

  - its files are there: tokenizer.json, or tokenizer_config.json with the vocabulary files its class builds from
    without it (e.g. Qwen2's vocab.json and merges.txt, Llama's tokenizer.model: the class's `vocab_files_names`);
  - its vocabulary fits the model's embedding: len(tokenizer) <= config.json's vocab_size;
  - it has a padding token (`rl_megatron.batch.pad_token_id`: pad, else end-of-sequence), and its end-of-sequence
    and padding ids lie inside its vocabulary.

A teacher (on-policy distillation) must share the policy's tokenizer: `check_shared_tokenizer` compares their
vocabularies. Whether the data's prompts encode to tokens is the data package's check (`rl_megatron.data.section`).
"""
from __future__ import annotations

import json
import os

from rl_megatron.batch import pad_token_id
from rl_megatron.errors import ConfigError, one_line

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
# Entries of a tokenizer class's vocab_files_names that are no vocabulary: tokenizer.json (checked first) and
# tokenizer_config.json (settings; the class and special tokens).
NOT_VOCABULARY = ("tokenizer_file", "tokenizer_config_file")
COPY_FIX = ("Copy the tokenizer files (tokenizer.json, tokenizer_config.json, and vocab.json / merges.txt / "
            "tokenizer.model where the model has them) from the model's original folder into it.")

# The tokenizers loaded, by absolute folder path: (its files' names, sizes and mtimes, the tokenizer). The policy's
# and a teacher's (whose vocabulary is compared with the policy's) are each loaded once.
_loaded: dict[str, tuple[tuple, object]] = {}


def load_tokenizer(model_path: str, key: str = "model.path"):
    """`model_path`'s tokenizer (AutoTokenizer.from_pretrained), unchecked. Loaded once per process: while the
    folder's files are unchanged, the next call returns the same object. ConfigError naming `key` (the config key
    naming the folder) if it does not load."""
    folder, signature = os.path.abspath(model_path), _files_signature(model_path)
    if folder in _loaded and _loaded[folder][0] == signature:
        return _loaded[folder][1]
    # Imported here, not at the top: importing transformers takes seconds, and a config error found before the
    # model folder is checked is reported without them (as rl_megatron.train imports the trainer only after).
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception as err:  # broken or foreign tokenizer files fail inside transformers and tokenizers in many ways
        tokenizer_class = _class_of_folder(model_path)
        if tokenizer_class is not None:
            _check_files(tokenizer_class, model_path)  # a missing file (e.g. merges.txt beside vocab.json) named
        raise ConfigError(f"{key}='{model_path}': its tokenizer does not load ({type(err).__name__}: "
                          f"{one_line(err)}). {COPY_FIX}") from None
    _loaded[folder] = (signature, tokenizer)
    return tokenizer


def _class_of_folder(model_path: str):
    """The tokenizer class AutoTokenizer picks for the folder (tokenizer_config.json's tokenizer_class, else the
    one of config.json's model_type), or None where that cannot be told."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    try:
        name = None
        if os.path.isfile(os.path.join(model_path, CONFIG_FILE)):
            with open(os.path.join(model_path, CONFIG_FILE)) as f:
                name = json.load(f).get("tokenizer_class")
        if not name:
            with open(os.path.join(model_path, "config.json")) as f:
                name = TOKENIZER_MAPPING_NAMES.get(json.load(f).get("model_type"))
        return tokenizer_class_from_name(name) if isinstance(name, str) else None
    except (OSError, ValueError, AttributeError):  # unreadable or odd files: the load error says enough
        return None


def _files_signature(folder: str) -> tuple:
    """Name, size and modification time of each file in `folder` but the weights: changes when a file changes."""
    with os.scandir(folder) as entries:
        return tuple(sorted((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns) for entry in entries
                            if entry.is_file() and not entry.name.endswith(".safetensors")))


def checked_tokenizer(model_path: str, hf: dict):
    """`model_path`'s tokenizer (`load_tokenizer`), checked against the folder and the model of config.json `hf`
    (see the module's docstring). ConfigError naming model.path, the file or token and the fix on the first problem."""
    tokenizer = load_tokenizer(model_path)
    source = _check_files(type(tokenizer), model_path)
    size, vocab_size = len(tokenizer), hf["vocab_size"]
    if size > vocab_size:
        raise ConfigError(f"model.path='{model_path}': the tokenizer ({source}) has {size} tokens, more than "
                          f"config.json's vocab_size={vocab_size}: ids from {vocab_size} on have no embedding row. Use "
                          "the tokenizer saved with this model (the tokenizer files of another model do not fit it).")
    pad = pad_token_id(tokenizer)
    if pad is None:
        raise ConfigError(f"model.path='{model_path}': the tokenizer ({source}) has neither a padding nor an "
                          "end-of-sequence token (the batches are padded with pad, else eos). Set eos_token (and "
                          "pad_token, if the model has one) in tokenizer_config.json, as the model's original "
                          "folder has them.")
    for what, token, token_id in (("end-of-sequence", tokenizer.eos_token, tokenizer.eos_token_id),
                                  ("padding", tokenizer.pad_token if tokenizer.pad_token_id is not None
                                   else tokenizer.eos_token, pad)):
        if token_id is not None and not 0 <= token_id < size:
            raise ConfigError(f"model.path='{model_path}': the tokenizer's {what} token {token!r} has id {token_id}, "
                              f"outside its vocabulary of {size} tokens ({source}). Fix the token in "
                              f"tokenizer_config.json, or use the tokenizer saved with this model.")
    return tokenizer


def check_shared_tokenizer(policy_tokenizer, teacher_path: str, key: str = "teacher.model.path") -> None:
    """A teacher scores the token ids the policy samples, so both must read them alike: the teacher's tokenizer
    (`teacher_path`, named by `key`) must have the policy's vocabulary, every token with the same id. ConfigError
    naming `key`, the first token that differs and the fix otherwise."""
    teacher_tokenizer = load_tokenizer(teacher_path, key)
    policy, teacher = policy_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if policy == teacher:
        return
    by_id = [{token_id: token for token, token_id in vocabulary.items()} for vocabulary in (policy, teacher)]
    differing = sorted(token_id for token_id in by_id[0].keys() | by_id[1].keys()
                       if by_id[0].get(token_id) != by_id[1].get(token_id))
    first = differing[0]
    raise ConfigError(
        f"{key}='{teacher_path}': the teacher's tokenizer is not the policy's (model.path): {len(teacher)} tokens "
        f"against {len(policy)}, and id {first} is {by_id[1].get(first)!r} to the teacher but "
        f"{by_id[0].get(first)!r} to the policy ({len(differing)} ids differ). On-policy distillation scores the "
        "policy's sampled token ids under the teacher, so both must share one tokenizer: use a teacher saved with the "
        "policy's tokenizer (e.g. a larger model of the same family), or set teacher.model.path=null.")


def _check_files(tokenizer_class, model_path: str) -> str:
    """The files a tokenizer of `tokenizer_class` is built from in the folder (for messages): tokenizer.json, else
    tokenizer_config.json and the vocabulary files of the class, each of which must exist (without them transformers
    builds an empty tokenizer)."""
    if os.path.isfile(os.path.join(model_path, TOKENIZER_FILE)):
        return TOKENIZER_FILE
    vocabulary = [name for entry, name in tokenizer_class.vocab_files_names.items() if entry not in NOT_VOCABULARY]
    needed = [CONFIG_FILE, *vocabulary]
    missing = [name for name in needed if not os.path.isfile(os.path.join(model_path, name))]
    if missing or not vocabulary:
        otherwise = f", or from {' + '.join(needed)}" if vocabulary else ""
        raise ConfigError(f"model.path='{model_path}' has no tokenizer: {tokenizer_class.__name__} (the model's "
                          f"tokenizer class) is built from {TOKENIZER_FILE}{otherwise}, and the folder lacks "
                          f"{', '.join([TOKENIZER_FILE, *missing])}; transformers would build an EMPTY tokenizer "
                          f"from it (every prompt encoded to no tokens). {COPY_FIX}")
    return " and ".join(needed)
