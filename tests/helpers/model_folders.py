"""Model folders at the size of released models, for what reads only their headers and config: complete
safetensors headers whose data sections are holes (sparse files: the right size, no disk, written in milliseconds),
and a small text tokenizer with a chat template."""
import json
import math
import os
import struct

from rl_megatron.models.family import table_for
from rl_megatron.models.hf_weights import DTYPE_BYTES, INDEX_FILE
from rl_megatron.models.tiny import TEXT, TOOL_CHAT_TEMPLATE, Vocabulary, build_tokenizer

CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def write_header_only_weights(folder: str, hf: dict, files: int = 1, dtype: str = "BF16") -> list[str]:
    """Every tensor the model of config.json `hf` loads (its weight table's, as the family's folders store them), in
    `files` safetensors files (with the index when more than one) whose data are holes. Returns the file names."""
    table = table_for(hf, hf["vocab_size"])
    tensors = list(table.stored_shapes(table.hf_tensors()).items())
    per_file = math.ceil(len(tensors) / files)
    names, weight_map = [], {}
    for number in range(files):
        name = "model.safetensors" if files == 1 else f"model-{number + 1:05d}-of-{files:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for tensor, shape in tensors[number * per_file:(number + 1) * per_file]:
            size = math.prod(shape) * DTYPE_BYTES[dtype]
            header[tensor] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            weight_map[tensor] = name
            offset += size
        raw = json.dumps(header).encode()
        with open(os.path.join(folder, name), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)  # the data section: a hole
        names.append(name)
    if files > 1:
        with open(os.path.join(folder, INDEX_FILE), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return names


def write_text_tokenizer(folder: str) -> None:
    """The tiny model's printable-ASCII tokenizer, with a chat template: real task prompts encode to tokens."""
    tokenizer = build_tokenizer(TEXT)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


# Printable ASCII with Qwen's chat markers and tool tags as tokens, and the tool demo's chat template (Qwen2.5's tool
# format): what a multi-turn recipe's pre-flight check needs of an instruct model's tokenizer. <|im_end|> is id 2.
TOOL_TEXT = Vocabulary(TEXT.characters, special=("<pad>", "<bos>", "<|im_end|>", "<unk>", "<|im_start|>"),
                       words=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
                       chat_template=TOOL_CHAT_TEMPLATE)


def write_tool_text_tokenizer(folder: str) -> None:
    build_tokenizer(TOOL_TEXT).save_pretrained(folder)
