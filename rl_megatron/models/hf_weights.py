"""The safetensors weights of a Hugging Face model folder, checked before any worker loads them.

The workers read model.path's weights long after start (`models.gpt.load_hf_weights`, once Ray and Megatron are up):
a missing, truncated or foreign file would cost a cluster's start-up and end in a worker's traceback. This module
finds the same problems from the files' headers alone (no tensor data is read, so a 70B folder takes well under a
second): every file the index names exists, every header parses and its tensors' data lie inside the file, and every
tensor the model's weight table loads is there with the shape config.json implies (one stored in MXFP4, as gpt-oss's
experts are released, as its blocks and scales: `models/mxfp4.py`).

A safetensors file is an 8-byte little-endian header length n, n bytes of JSON header, then the data section. The
header maps each tensor's name to {"dtype", "shape", "data_offsets": [begin, end]}, the offsets counting from the
start of the data section (and an optional "__metadata__" entry of strings).
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

from rl_megatron.errors import ConfigError, one_line
from rl_megatron.models import mxfp4
from rl_megatron.models.family import table_for

INDEX_FILE = "model.safetensors.index.json"  # a sharded folder's map of tensor name -> file
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit: larger means it is not a safetensors file
# Bytes per element of the safetensors dtypes; a dtype not listed here (e.g. 4-bit) skips the size check.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


class SafetensorsFileError(ValueError):
    """A file that is not a complete safetensors file; the message says what is wrong with it."""


@dataclass(frozen=True)
class TensorHeader:
    """One tensor's entry in a safetensors header: its dtype, shape and [begin, end) bytes in the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_safetensors_header(path: str) -> dict[str, TensorHeader]:
    """The tensors of the safetensors file at `path`, from its header alone, checked against the file's size: the
    header is whole and a JSON object of well-formed entries, and every tensor's data lies inside the data section
    and is as long as its dtype and shape need. SafetensorsFileError saying what is wrong otherwise."""
    size = os.path.getsize(path)
    if size < HEADER_LENGTH_BYTES:
        raise SafetensorsFileError(f"it has {size} bytes, fewer than the {HEADER_LENGTH_BYTES} of the header length "
                                   "that starts every safetensors file")
    with open(path, "rb") as f:
        (header_bytes,) = struct.unpack("<Q", f.read(HEADER_LENGTH_BYTES))
        if header_bytes > min(size - HEADER_LENGTH_BYTES, MAX_HEADER_BYTES):
            raise SafetensorsFileError(f"its header length says {header_bytes} bytes, but only "
                                       f"{size - HEADER_LENGTH_BYTES} bytes follow it (cut short, or not a "
                                       "safetensors file)")
        raw = f.read(header_bytes)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        raise SafetensorsFileError(f"its header is not JSON ({one_line(err)})") from None
    if not isinstance(header, dict):
        raise SafetensorsFileError(f"its header is a JSON {type(header).__name__}, not an object")
    data_bytes = size - HEADER_LENGTH_BYTES - header_bytes
    return {name: _tensor_header(name, entry, data_bytes, size) for name, entry in header.items()
            if name != "__metadata__"}


def _tensor_header(name: str, entry, data_bytes: int, file_bytes: int) -> TensorHeader:
    """One header entry, checked: well-formed, its data inside the data section of `data_bytes` bytes."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        well_formed = (isinstance(dtype, str) and isinstance(shape, list)
                       and all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end)) and begin <= end)
    except (TypeError, KeyError, ValueError):  # not a dict, a key missing, data_offsets not a pair
        well_formed = False
    if not well_formed:
        raise SafetensorsFileError(f"the header entry of tensor '{name}' is malformed ({entry!r:.120}); a tensor's "
                                   "entry is {\"dtype\", \"shape\", \"data_offsets\": [begin, end]}")
    if end > data_bytes:
        raise SafetensorsFileError(f"tensor '{name}' ends at byte {file_bytes - data_bytes + end}, but the file has "
                                   f"{file_bytes} bytes (cut short)")
    if dtype in DTYPE_BYTES and end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise SafetensorsFileError(f"tensor '{name}' ({dtype}, shape {shape}) needs "
                                   f"{math.prod(shape) * DTYPE_BYTES[dtype]} bytes, but its data_offsets give "
                                   f"{end - begin}")
    return TensorHeader(dtype, tuple(shape), begin, end)


def check_hf_weights(folder: str, hf: dict, key: str, output_layer: bool = True,
                     head: dict[str, tuple[int, ...]] | None = None) -> None:
    """Check the safetensors of `folder` (the value of config key `key`) from their headers: everything
    `models.gpt.load_hf_weights` will read for the model of config.json `hf` is there, whole and of the right shape.
    The tensors are the weight table's (`DenseTable.hf_tensors`), the one list the loader looks its parameters up
    in; `output_layer=False` for a critic or a reward model, whose scalar head replaces the output layer, and `head`
    the tensors of a head loaded besides (a reward model's score: `models/score_head.py`). ConfigError naming `key`,
    the file and the fix on the first problem."""
    files, weight_map = _weight_files(folder, key)
    headers = {file: _read_header(folder, file, key) for file in files}
    if not weight_map:  # no index: every tensor of every file (a later file's copy wins, as in the loader)
        weight_map = {name: file for file in files for name in headers[file]}
    try:
        table = table_for(hf, hf["vocab_size"])
        needed = {**table.stored_shapes(table.hf_tensors(output_layer)), **(head or {})}
    except ValueError as err:  # a family rl_megatron does not support (the pre-flight's model check names it first)
        raise ConfigError(f"{key}='{folder}': {one_line(err)}") from None
    fix = (f"{key} must hold the weights of the model its config.json describes ({hf.get('model_type')}, "
           f"{hf['num_hidden_layers']} layers, hidden_size={hf['hidden_size']}, vocab_size={hf['vocab_size']}): "
           "use the config.json saved with these weights, or a complete folder (`python -m rl_megatron.convert "
           "to-hf` writes one from a checkpoint); or set model.random_init=true to start from random weights.")
    for name, shape in needed.items():
        file = weight_map.get(name)
        if file is None and mxfp4.packed_names(name).blocks in weight_map:  # gpt-oss's experts as released
            _check_mxfp4(folder, key, name, tuple(shape), weight_map, headers, fix)
            continue
        if file is None:
            where = (f"{INDEX_FILE} does not list it" if os.path.isfile(os.path.join(folder, INDEX_FILE))
                     else f"none of its {len(files)} *.safetensors files ({_names(files)}) holds it")
            raise ConfigError(f"{key}='{folder}' lacks tensor '{name}', which the model needs: {where}. {fix}")
        tensor = headers[file].get(name)
        if tensor is None:
            raise ConfigError(f"{key}='{folder}': {INDEX_FILE} places tensor '{name}' in '{file}', which does not "
                              f"hold it. Download or copy '{file}' and the index again.")
        if tensor.shape != tuple(shape):
            raise ConfigError(f"{key}='{folder}': tensor '{name}' in '{file}' has shape {list(tensor.shape)}, but "
                              f"config.json implies {list(shape)}. {fix}")


def _check_mxfp4(folder: str, key: str, name: str, shape: tuple[int, ...], weight_map: dict[str, str],
                 headers: dict[str, dict[str, TensorHeader]], fix: str) -> None:
    """Tensor `name` of `shape`, stored in MXFP4 (models/mxfp4.py): its blocks and scales are there, uint8, of the
    shapes that `shape` packs into. ConfigError naming the tensor and its file otherwise."""
    packed = mxfp4.packed_names(name)
    expected = dict(zip((packed.blocks, packed.scales), mxfp4.packed_shapes(shape)))
    for part, part_shape in expected.items():
        file = weight_map.get(part)
        tensor = headers[file].get(part) if file is not None else None
        if tensor is None:
            where = f"'{file}' does not hold it" if file is not None else "no file of the folder holds it"
            raise ConfigError(f"{key}='{folder}' stores tensor '{name}' in MXFP4 ('{packed.blocks}' in "
                              f"'{weight_map[packed.blocks]}'), but '{part}' is missing: {where}. Download or copy "
                              "the folder's *.safetensors and index again.")
        if tensor.dtype != "U8" or tensor.shape != part_shape:
            raise ConfigError(f"{key}='{folder}': tensor '{part}' in '{file}' is {tensor.dtype} of shape "
                              f"{list(tensor.shape)}, but the MXFP4 form of '{name}' {list(shape)} is U8 of shape "
                              f"{list(part_shape)}. {fix}")


def _weight_files(folder: str, key: str) -> tuple[list[str], dict[str, str]]:
    """The safetensors files the loader reads and the index's tensor -> file map: with an index (a sharded model)
    the files it names, which must all exist; without one every *.safetensors file (and an empty map)."""
    if not os.path.isdir(folder):
        raise ConfigError(f"{key}='{folder}' is not a folder (relative paths count from {os.getcwd()}). Point {key} "
                          "at a Hugging Face model folder (config.json, tokenizer files, *.safetensors).")
    index_path = os.path.join(folder, INDEX_FILE)
    if not os.path.isfile(index_path):
        files = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))
        if not files:
            others = sorted(name for name in os.listdir(folder) if name.endswith((".bin", ".pt", ".pth")))
            also = (f" It has {_names(others)}, which rl_megatron does not load: convert them to safetensors "
                    "(transformers' save_pretrained writes safetensors)." if others else "")
            raise ConfigError(f"{key}='{folder}' has no *.safetensors weights, which model.random_init=false loads."
                              f"{also} Point {key} at the model's folder with its *.safetensors files, or set "
                              "model.random_init=true to start from random weights.")
        return files, {}
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise ValueError("weight_map is not an object of tensor name -> file name")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{key}='{folder}': '{INDEX_FILE}' is not a safetensors index (JSON with a weight_map of "
                          f"tensor name -> file; {type(err).__name__}: {one_line(err)}). Download or copy it again, "
                          "or delete it if the folder holds a single model.safetensors.") from None
    files = sorted(set(weight_map.values()))
    for file in files:
        if not os.path.isfile(os.path.join(folder, file)):
            raise ConfigError(f"{key}='{folder}': '{INDEX_FILE}' places tensors in '{file}', which is missing (an "
                              "interrupted download or copy?). Download or copy that file into the folder.")
    return files, weight_map


def _read_header(folder: str, file: str, key: str) -> dict[str, TensorHeader]:
    try:
        return read_safetensors_header(os.path.join(folder, file))
    except SafetensorsFileError as err:
        raise ConfigError(f"{key}='{folder}': '{file}' is not a complete safetensors file: {err}. Download or copy "
                          "it again.") from None


def _names(files: list[str], shown: int = 3) -> str:
    return ", ".join(files[:shown]) + (f", ... ({len(files)} files)" if len(files) > shown else "")
