"""The language model of a released multimodal folder, taken out for training and put back beside what was not
trained.

Qwen3.5 is released as Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration (config.json model_type
qwen3_5 / qwen3_5_moe): a vision tower (model.visual.*), the language model under model.language_model.*, its
output layer (lm_head.weight), its multi-token-prediction layers (mtp.*), and the language model's config as
config.json's text_config. RL on text trains the language model alone. So, as slime converts a folder once before
its runs, rl_megatron takes the language model out once, as the text-only folder transformers itself would write for
Qwen3_5(Moe)ForCausalLM (model_type qwen3_5_text / qwen3_5_moe_text: `models/families/qwen3_5.py`), and after
training puts the trained tensors back under their names, every other tensor copied as released:

    python -m rl_megatron.convert language-model --hf Qwen3.5-35B-A3B --out Qwen3.5-35B-A3B-text
    ... train with model.path=Qwen3.5-35B-A3B-text, export the result (convert to-hf, or a run's HF save) ...
    python -m rl_megatron.convert into-multimodal --hf TRAINED --source Qwen3.5-35B-A3B --out Qwen3.5-35B-A3B-rl

Both stream one safetensors file at a time (a released shard is a few GB; the model never sits in memory whole).
The vision tower and the MTP layers are not trained: the MTP layers, which predict with the released trunk's hidden
states, draft less well for a trained one (speculative decoding stays correct, only its acceptance can drop).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

from safetensors import safe_open

from rl_megatron.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TEXT_PREFIX = "model."  # the language model's tensors in a text-only folder (its output layer: lm_head.weight)
OUTPUT_LAYER = "lm_head.weight"  # the same name in both folders


@dataclasses.dataclass(frozen=True)
class Multimodal:
    """A multimodal family whose language model rl_megatron trains: the folder's model_type and class, the text-only
    class its language model is, and where the folder keeps the language model's tensors."""
    model_type: str
    architecture: str
    text_architecture: str
    prefix: str = "model.language_model."

    def refusal(self, folder: str = "<folder>") -> str:
        """What a config naming the multimodal folder itself is told."""
        return (f"config.json model_type {self.model_type!r} is a multimodal folder ({self.architecture}): "
                f"rl_megatron trains its language model, as a text-only folder. Take it out once with `python -m "
                f"rl_megatron.convert language-model --hf {folder} --out {folder}-text` and name that folder instead; "
                "`python -m rl_megatron.convert into-multimodal` puts the trained weights back beside the untouched "
                "vision tower (docs/model-families.md).")

    def text_name(self, name: str) -> str | None:
        """A tensor's name in the text-only folder; None for one that is not the language model's."""
        if name.startswith(self.prefix):
            return TEXT_PREFIX + name[len(self.prefix):]
        return name if name == OUTPUT_LAYER else None


MULTIMODAL = {family.model_type: family for family in (
    Multimodal("qwen3_5", "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
    Multimodal("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
)}


def refuse_multimodal(hf: dict, source: str | None = None) -> None:
    """ConfigError (naming `source` where given) saying how to take the language model out, for a config.json of a
    multimodal folder named where a language model is expected."""
    family = MULTIMODAL.get(hf.get("model_type"))
    if family is not None:
        raise ConfigError(family.refusal() if source is None else f"{source}: {family.refusal()}")


def multimodal_of(hf: dict, source: str) -> Multimodal:
    """The multimodal family of a folder's config.json; ConfigError naming `source` when it is not one."""
    family = MULTIMODAL.get(hf.get("model_type"))
    if family is None or not isinstance(hf.get("text_config"), dict):
        known = ", ".join(f"{m.model_type} ({m.architecture})" for m in MULTIMODAL.values())
        raise ConfigError(f"{source}: config.json model_type {hf.get('model_type')!r} is not a multimodal folder "
                          f"whose language model rl_megatron takes out (those: {known}), or it has no text_config.")
    return family


def language_model_config(hf: dict) -> dict:
    """The config.json of the language model's text-only folder: text_config as its own file, with the class
    transformers builds for it and the folder-level fields a text model reads (tied embeddings, the dtype)."""
    family = multimodal_of(hf, "config.json")
    text = dict(hf["text_config"], architectures=[family.text_architecture])
    for field in ("tie_word_embeddings", "torch_dtype", "dtype", "transformers_version"):
        if field in hf and field not in text:
            text[field] = hf[field]
    return text


def extract_language_model(source: str, out: str, hf: dict, progress=print) -> int:
    """Write the language model of the multimodal folder `source` (config.json `hf`) into the existing folder `out`
    as a text-only folder; returns the number of tensors written."""
    family = multimodal_of(hf, source)
    written = {}

    def rename(file: str, names: list[str]) -> dict[str, str]:
        return {name: text for name in names if (text := family.text_name(name)) is not None}

    for file, tensors in _stream(source, rename):
        written.update(_save(tensors, out, file))
        progress(f"wrote {file} ({len(tensors)} tensors)")
    _write_index(out, written)
    _write_config(out, language_model_config(hf))
    _copy_side_files(source, out)
    return len(written)


def merge_language_model(trained: str, trained_hf: dict, source: str, source_hf: dict, out: str,
                         progress=print) -> int:
    """Write the multimodal folder `source` into the existing folder `out` with its language model's tensors taken
    from the text-only folder `trained` (the same model, trained): every other tensor, config.json and the side files
    as `source` has them. ConfigError naming the tensor when the two folders do not hold the same language model.
    Returns the number of tensors taken from `trained`."""
    family = multimodal_of(source_hf, source)
    expected = family.model_type + "_text"
    if trained_hf.get("model_type") != expected:
        raise ConfigError(f"{trained}: config.json model_type {trained_hf.get('model_type')!r} is not the language "
                          f"model of {source} ({expected!r}): give the folder trained from `convert language-model`'s "
                          "output.")
    trained_files = _weight_map(trained)
    trained_handles = {file: safe_open(os.path.join(trained, file), framework="pt")
                       for file in set(trained_files.values())}
    taken: set[str] = set()
    written = {}
    for file, names in _files(source):
        tensors = {}
        with safe_open(os.path.join(source, file), framework="pt") as released:
            for name in names:
                text = family.text_name(name)
                if text is None:
                    tensors[name] = released.get_tensor(name)
                    continue
                if text not in trained_files:
                    raise ConfigError(f"{trained} has no tensor {text!r} ({name} in {source}): it is not the "
                                      "language model of that folder.")
                tensor = trained_handles[trained_files[text]].get_tensor(text)
                shape = released.get_slice(name).get_shape()
                if list(tensor.shape) != list(shape):
                    raise ConfigError(f"{trained}: {text} has shape {list(tensor.shape)}, {source}'s {name} "
                                      f"{list(shape)}: they are not the same model.")
                tensors[name] = tensor
                taken.add(text)
        written.update(_save(tensors, out, file))
        progress(f"wrote {file} ({len(tensors)} tensors)")
    left = sorted(set(trained_files) - taken)
    if left:
        raise ConfigError(f"{trained} holds tensors {source} has no place for ({', '.join(left[:3])}...): it is not "
                          "the language model of that folder.")
    if os.path.isfile(os.path.join(source, INDEX_FILE)):
        _write_index(out, written)
    shutil.copy2(os.path.join(source, "config.json"), os.path.join(out, "config.json"))
    _copy_side_files(source, out)
    return len(taken)


def _files(folder: str) -> list[tuple[str, list[str]]]:
    """The folder's safetensors files in order, each with the tensor names it holds."""
    by_file: dict[str, list[str]] = {}
    for name, file in _weight_map(folder).items():
        by_file.setdefault(file, []).append(name)
    return sorted(by_file.items())


def _weight_map(folder: str) -> dict[str, str]:
    """Tensor name -> file, from the index, or from the one file's header."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    with safe_open(os.path.join(folder, SINGLE_FILE), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), SINGLE_FILE)


def _stream(folder: str, rename):
    """(file, {new name: tensor}) for each safetensors file of `folder`, the tensors `rename(file, names)` maps."""
    for file, names in _files(folder):
        mapping = rename(file, names)
        if not mapping:
            continue
        with safe_open(os.path.join(folder, file), framework="pt") as handle:
            yield file, {new: handle.get_tensor(old) for old, new in mapping.items()}


def _save(tensors: dict, out: str, file: str) -> dict[str, tuple[str, int]]:
    from safetensors.torch import save_file  # imports torch: not on the dry run's path, which reads MULTIMODAL

    save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
    return {name: (file, t.numel() * t.element_size()) for name, t in tensors.items()}


def _write_index(out: str, written: dict[str, tuple[str, int]]) -> None:
    index = {"metadata": {"total_size": sum(size for _, size in written.values())},
             "weight_map": {name: file for name, (file, _) in sorted(written.items())}}
    with open(os.path.join(out, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)


def _write_config(out: str, config: dict) -> None:
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _copy_side_files(source: str, out: str) -> None:
    """Every file of `source` that is neither a weight file, its index nor config.json: the tokenizer, the chat
    template, the generation config (the processors' configs too: harmless to a text model, kept for provenance)."""
    for name in os.listdir(source):
        path = os.path.join(source, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name not in (INDEX_FILE, "config.json"):
            shutil.copy2(path, os.path.join(out, name))
