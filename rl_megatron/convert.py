"""Conversion between Hugging Face model folders and rl_megatron's Megatron checkpoints.

    python -m rl_megatron.convert from-hf --hf MODEL_DIR --out CKPT --tp 2 --pp 2
    python -m rl_megatron.convert to-hf --ckpt CKPT --out HF_DIR [--dtype bf16]
    python -m rl_megatron.convert to-peft --ckpt CKPT --out ADAPTER_DIR     (a LoRA run's checkpoint)
    python -m rl_megatron.convert language-model --hf MULTIMODAL_DIR --out TEXT_DIR      (Qwen3.5's released folders)
    python -m rl_megatron.convert into-multimodal --hf TRAINED_TEXT_DIR --source MULTIMODAL_DIR --out HF_DIR

Each command starts the local processes its layout needs (gloo on CPU) by itself. Weights move through the same
weight table and export code the trainer uses (`models.gpt.load_hf_weights`, `resharding.export_hf_state_dict`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from rl_megatron.checkpoint.atomic import finish_partial, start_partial
from rl_megatron.cli import run_command
from rl_megatron.errors import ConfigError

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}
DEFAULT_VOCAB_DIVISOR = 128  # the trainer's default model.make_vocab_size_divisible_by

FROM_HF_EXAMPLES = """examples:
  python -m rl_megatron.convert from-hf --hf Qwen2.5-0.5B-Instruct --out ckpt/qwen --tp 2 --pp 2
  python -m rl_megatron.convert from-hf --hf Qwen3-30B-A3B --out ckpt/moe --tp 2 --ep 4

The checkpoint loads under any TP/PP layout later (Megatron distributed checkpointing). It holds the model's
config.json, generation config and tokenizer files and rl_megatron_checkpoint.json next to the shards."""

TO_HF_EXAMPLES = """examples:
  python -m rl_megatron.convert to-hf --ckpt ckpt/qwen --out qwen-hf
  python -m rl_megatron.convert to-hf --ckpt ckpt/qwen --out qwen-hf-bf16 --dtype bf16 --tp 2

The output is laid out as transformers' save_pretrained writes it (for from_pretrained and vLLM). A LoRA run's
checkpoint (actor.lora) is written with its adapters merged into the weights."""

TO_PEFT_EXAMPLES = """examples:
  python -m rl_megatron.convert to-peft --ckpt runs/demo_cpu_lora/checkpoints/global_step_100/actor --out adapter

The output is a PEFT adapter folder (adapter_config.json, adapter_model.safetensors): PeftModel.from_pretrained(base,
folder) in transformers, or a LoRA request in vLLM (enable_lora=True), on the base model the run started from."""


LANGUAGE_MODEL_EXAMPLES = """examples:
  python -m rl_megatron.convert language-model --hf Qwen3.5-35B-A3B --out Qwen3.5-35B-A3B-text

Train with model.path=Qwen3.5-35B-A3B-text (a Qwen3_5MoeForCausalLM folder, as transformers writes one); the vision
tower and the multi-token-prediction layers are left out (into-multimodal puts them back as released)."""

INTO_MULTIMODAL_EXAMPLES = """examples:
  python -m rl_megatron.convert into-multimodal --hf qwen3.5-rl-hf --source Qwen3.5-35B-A3B --out Qwen3.5-35B-A3B-rl

--hf is the trained language model as an HF folder (convert to-hf, or a run's export); the output is --source with
the language model's tensors replaced, every other tensor, config.json and the processor files as released."""


class ConvertError(Exception):
    """A problem with the command's inputs, printed as `error: ...` without a traceback."""


def _say(message: str) -> None:
    print(f"[convert] {message}", flush=True)


def _expert_tp(hf: dict) -> int | None:
    """The experts' TP size conversion runs at: 1 where they have biases (Megatron builds those at expert-TP 1 only;
    a checkpoint is the same at any layout), Megatron's default (the TP size) otherwise."""
    from rl_megatron.models.family import family_of

    return 1 if family_of(hf).expert_biases else None


def _check_layout(hf: dict, source: str, tp: int, pp: int, ep: int) -> None:
    """The model against the layout the command runs at: the trainer's check, naming the command's flags."""
    from rl_megatron.config import ConfigError
    from rl_megatron.models.checks import check_model_layout

    for name, value in (("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if value < 1:
            raise ConvertError(f"{name}={value} must be at least 1.")
    try:
        check_model_layout(hf, ("--tp", tp), ("--pp", pp), ("--ep", ep), source=source)
    except ConfigError as err:
        raise ConvertError(str(err)) from None


def _new_output(path: str) -> str:
    """The temporary folder to write into (not yet created), renamed to `path` at the end (so `path` is whole or
    absent)."""
    if os.path.exists(path):
        raise ConvertError(f"'{path}' already exists; choose a new output folder.")
    return start_partial(path, create=False)  # the first rank creates it


def _rank_from_hf(hf_dir: str, hf: dict, ckpt_dir: str, dtype: str, vocab_divisor: int) -> None:
    import torch.distributed as dist

    from rl_megatron.checkpoint import save_model_checkpoint
    from rl_megatron.models.gpt import build_gpt_chunks, load_hf_weights

    first = dist.get_rank() == 0
    chunks = build_gpt_chunks(hf, dtype, vocab_divisor)
    if first:
        _say(f"loading HF weights into {dist.get_world_size()} ranks")
    for chunk in chunks:
        load_hf_weights(chunk, hf, hf_dir)
    if first:
        _say(f"saving Megatron distributed checkpoint to {ckpt_dir}")
    save_model_checkpoint(chunks, ckpt_dir, hf, hf_files_dir=hf_dir)


def _load_checkpoint(ckpt_dir: str, hf: dict, vocab_divisor: int) -> list:
    """This rank's chunks of the checkpoint, with its LoRA adapters where it has them."""
    import torch.distributed as dist

    from rl_megatron.checkpoint import load_checkpoint_into, read_checkpoint_metadata
    from rl_megatron.config.schema import LoraConfig
    from rl_megatron.models.gpt import build_gpt_chunks, layer_offset, weight_table
    from rl_megatron.models.lora import add_adapters

    metadata = read_checkpoint_metadata(ckpt_dir)
    chunks = build_gpt_chunks(hf, metadata["dtype"], vocab_divisor)
    lora = metadata.get("lora")
    for chunk in chunks if lora else ():
        add_adapters(chunk, weight_table(chunk, hf), LoraConfig(**lora), layer_offset(chunk), seed=0)
    if dist.get_rank() == 0:
        _say(f"loading {ckpt_dir} into {dist.get_world_size()} ranks" + (" (with its LoRA adapters)" if lora else ""))
    load_checkpoint_into(chunks, ckpt_dir, hf, lora=lora)
    return chunks


def _rank_to_hf(ckpt_dir: str, hf: dict, out_dir: str, dtype: str, vocab_divisor: int, max_shard_bytes: int) -> None:
    import torch.distributed as dist

    from rl_megatron.checkpoint import write_hf_folder
    from rl_megatron.models.gpt import DTYPES, weight_table
    from rl_megatron.models.lora import MergedWeights
    from rl_megatron.resharding import export_hf_state_dict

    first = dist.get_rank() == 0
    chunks = _load_checkpoint(ckpt_dir, hf, vocab_divisor)
    merged = MergedWeights(chunks)  # nothing without adapters
    merged.refresh()
    if first:
        _say("gathering the full HF state dict on rank 0" + (" (adapters merged)" if merged.layers else ""))
    state = export_hf_state_dict(chunks, weight_table(chunks[0], hf), substitutes=merged.substitutes())
    if first:
        os.makedirs(out_dir)
        write_hf_folder(state, out_dir, hf, ckpt_dir, DTYPES[dtype], max_shard_bytes, progress=_say)
    dist.barrier()


def _rank_to_peft(ckpt_dir: str, hf: dict, out_dir: str, dtype: str, vocab_divisor: int, base: str) -> None:
    import torch.distributed as dist

    from rl_megatron.checkpoint import read_checkpoint_metadata
    from rl_megatron.models.gpt import DTYPES
    from rl_megatron.models.lora import adapter_tensors, peft_adapter_files

    chunks = _load_checkpoint(ckpt_dir, hf, vocab_divisor)
    stages = [None] * dist.get_world_size()  # every pipeline stage's adapters, whole over TP
    dist.all_gather_object(stages, adapter_tensors(chunks))
    if dist.get_rank() == 0:
        tensors = {name: tensor.to(DTYPES[dtype]) for stage in stages for name, tensor in stage.items()}
        peft_adapter_files(tensors, read_checkpoint_metadata(ckpt_dir)["lora"], base, out_dir)
        _say(f"wrote {len(tensors)} adapter tensors")
    dist.barrier()


def _hf_dtype(hf: dict) -> str:
    """The parameter dtype to keep an HF model in: bf16 stays bf16; fp32 stays fp32, fp16 widens exactly to fp32."""
    name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    return "bfloat16" if name == "bfloat16" else "float32"


def from_hf(args) -> None:
    from rl_megatron.config import ConfigError
    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.models.gpt import SafetensorsReader
    from rl_megatron.workers.spawn import run_distributed

    try:
        hf = read_hf_config(args.hf)
    except ConfigError as err:
        raise ConvertError(str(err).replace("model.path", "--hf")) from None
    try:
        SafetensorsReader(args.hf)
    except FileNotFoundError as err:
        raise ConvertError(str(err)) from None
    _check_layout(hf, f"{args.hf}/config.json", args.tp, args.pp, args.ep)
    dtype = DTYPE_NAMES[args.dtype] if args.dtype else _hf_dtype(hf)
    if os.path.exists(args.out):
        raise ConvertError(f"'{args.out}' already exists; choose a new output folder.")
    world = args.tp * args.pp * args.ep
    _say(f"{args.hf} ({hf['model_type']}, {hf['num_hidden_layers']} layers) -> {args.out}: "
         f"TP={args.tp} PP={args.pp} EP={args.ep}, {world} process(es), {dtype}")
    start = time.perf_counter()
    run_distributed(_rank_from_hf, world, args.tp, args.pp, ep=args.ep, etp=_expert_tp(hf),
                    args=(args.hf, hf, args.out, dtype, args.make_vocab_size_divisible_by))
    _say(f"done in {time.perf_counter() - start:.1f} s: {args.out}")


def _from_checkpoint(args) -> tuple[dict, dict, str, str]:
    """What to-hf and to-peft start from: the checkpoint's config.json and metadata (checked), the dtype to write,
    and the temporary output folder."""
    from rl_megatron.checkpoint import check_checkpoint, stored_hf_config

    hf = stored_hf_config(args.ckpt) if os.path.isdir(args.ckpt) else {}
    metadata = check_checkpoint(args.ckpt, hf)  # a missing folder, metadata or shard fails here, clearly
    _check_layout(hf, f"{args.ckpt}/config.json", args.tp, args.pp, 1)
    dtype = DTYPE_NAMES[args.dtype] if args.dtype else metadata["dtype"]
    return hf, metadata, dtype, _new_output(args.out)


def to_hf(args) -> None:
    from rl_megatron.workers.spawn import run_distributed

    hf, metadata, dtype, partial = _from_checkpoint(args)
    world = args.tp * args.pp
    saved = metadata["source_layout"]
    _say(f"{args.ckpt} (saved at TP={saved['tp']} PP={saved['pp']}) -> {args.out}: loading at TP={args.tp} "
         f"PP={args.pp}, {world} process(es), writing {dtype}")
    start = time.perf_counter()
    run_distributed(_rank_to_hf, world, args.tp, args.pp, etp=_expert_tp(hf),
                    args=(args.ckpt, hf, partial, dtype, args.make_vocab_size_divisible_by,
                          int(args.max_shard_size_gb * (1 << 30))))
    finish_partial(args.out)
    _say(f"done in {time.perf_counter() - start:.1f} s: {args.out}")


def to_peft(args) -> None:
    from rl_megatron.checkpoint import read_checkpoint_metadata
    from rl_megatron.workers.spawn import run_distributed

    if os.path.isdir(args.ckpt) and not read_checkpoint_metadata(args.ckpt).get("lora"):
        raise ConvertError(f"'{args.ckpt}' holds no LoRA adapters (its run had no actor.lora): convert it with "
                           "to-hf instead.")
    hf, metadata, dtype, partial = _from_checkpoint(args)
    base = args.base_model or hf.get("_name_or_path") or ""
    _say(f"{args.ckpt} -> {args.out}: the LoRA adapters (rank {metadata['lora']['rank']}), {dtype}")
    run_distributed(_rank_to_peft, args.tp * args.pp, args.tp, args.pp,
                    args=(args.ckpt, hf, partial, dtype, args.make_vocab_size_divisible_by, base))
    finish_partial(args.out)
    _say(f"done: {args.out}")


def language_model(args) -> None:
    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.models.multimodal import extract_language_model, multimodal_of

    hf = read_hf_config(args.hf, "--hf")
    family = multimodal_of(hf, args.hf)
    partial = _new_output(args.out)
    os.makedirs(partial)
    _say(f"{args.hf} ({family.architecture}) -> {args.out}: its language model as {family.text_architecture}")
    count = extract_language_model(args.hf, partial, hf, progress=_say)
    finish_partial(args.out)
    _say(f"done: {count} tensors in {args.out}")


def into_multimodal(args) -> None:
    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.models.multimodal import merge_language_model

    trained, source = read_hf_config(args.hf, "--hf"), read_hf_config(args.source, "--source")
    partial = _new_output(args.out)
    os.makedirs(partial)
    _say(f"{args.source} with the language model of {args.hf} -> {args.out}")
    count = merge_language_model(args.hf, trained, args.source, source, partial, progress=_say)
    finish_partial(args.out)
    _say(f"done: {count} tensors of the language model replaced, the rest as released, in {args.out}")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m rl_megatron.convert", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = top.add_subparsers(dest="command", required=True)
    raw = argparse.RawDescriptionHelpFormatter

    a = commands.add_parser("from-hf", help="HF model folder -> Megatron distributed checkpoint",
                            description="Convert an HF model folder (config.json, *.safetensors, tokenizer) into a "
                                        "Megatron distributed checkpoint the trainer can start from.",
                            epilog=FROM_HF_EXAMPLES, formatter_class=raw)
    a.add_argument("--hf", required=True, help="HF model folder")
    a.add_argument("--out", required=True, help="checkpoint folder to create (must not exist)")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel size to convert with (default 1)")
    a.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to convert with (default 1)")
    a.add_argument("--ep", type=int, default=1, help="expert-parallel size, MoE models only (default 1)")
    a.add_argument("--dtype", choices=sorted(DTYPE_NAMES),
                   help="parameter dtype of the checkpoint (default: the model's; fp16 is kept as fp32)")
    a.set_defaults(run=from_hf)

    b = commands.add_parser("to-hf", help="Megatron distributed checkpoint -> HF model folder",
                            description="Convert a checkpoint written by from-hf or the trainer into an HF model "
                                        "folder (safetensors shards with index, config.json, generation config, "
                                        "tokenizer files).", epilog=TO_HF_EXAMPLES, formatter_class=raw)
    b.add_argument("--ckpt", required=True, help="checkpoint folder")
    b.add_argument("--out", required=True, help="HF folder to create (must not exist)")
    b.add_argument("--dtype", choices=sorted(DTYPE_NAMES), help="dtype of the written weights (default: the "
                                                                "checkpoint's)")
    b.add_argument("--max-shard-size-gb", type=float, default=5.0, help="largest safetensors file (default 5)")
    b.set_defaults(run=to_hf)

    c = commands.add_parser("to-peft", help="a LoRA run's checkpoint -> PEFT adapter folder",
                            description="Write the LoRA adapters of a checkpoint saved by a run with actor.lora as a "
                                        "PEFT adapter folder (adapter_config.json, adapter_model.safetensors).",
                            epilog=TO_PEFT_EXAMPLES, formatter_class=raw)
    c.add_argument("--ckpt", required=True, help="checkpoint folder (a LoRA run's actor/)")
    c.add_argument("--out", required=True, help="adapter folder to create (must not exist)")
    c.add_argument("--dtype", choices=sorted(DTYPE_NAMES), help="dtype of the written adapters (default: the "
                                                                "checkpoint's)")
    c.add_argument("--base-model", help="base_model_name_or_path written in adapter_config.json (default: the "
                                        "checkpoint's config.json _name_or_path, if any)")
    c.set_defaults(run=to_peft)

    d = commands.add_parser("language-model", help="multimodal HF folder -> its language model as a text-only folder",
                            description="Write the language model of a multimodal folder (Qwen3.5's "
                                        "*ForConditionalGeneration) as a text-only HF folder to train.",
                            epilog=LANGUAGE_MODEL_EXAMPLES, formatter_class=raw)
    d.add_argument("--hf", required=True, help="the multimodal HF folder, as released")
    d.add_argument("--out", required=True, help="text-only folder to create (must not exist)")
    d.set_defaults(run=language_model)

    e = commands.add_parser("into-multimodal", help="a trained language model back into its multimodal folder",
                            description="Write the multimodal folder --source with its language model's tensors "
                                        "taken from the trained text-only folder --hf; the rest unchanged.",
                            epilog=INTO_MULTIMODAL_EXAMPLES, formatter_class=raw)
    e.add_argument("--hf", required=True, help="the trained language model, a text-only HF folder")
    e.add_argument("--source", required=True, help="the multimodal folder it was taken from (convert language-model)")
    e.add_argument("--out", required=True, help="multimodal folder to create (must not exist)")
    e.set_defaults(run=into_multimodal)

    for command in (b, c):
        command.add_argument("--tp", type=int, default=1, help="tensor-parallel size to load the checkpoint at "
                                                               "(default 1)")
        command.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to load the checkpoint at "
                                                               "(default 1)")

    for command in (a, b, c):
        command.add_argument("--make-vocab-size-divisible-by", type=int, default=DEFAULT_VOCAB_DIVISOR,
                             help="Megatron's vocabulary padding multiple (default 128; any value loads any "
                                  "checkpoint: padding rows are not part of the model)")
    return top


def main(argv=None) -> int:
    from rl_megatron.checkpoint import CheckpointError

    args = parser().parse_args(argv)
    return run_command(lambda: args.run(args), ConvertError, CheckpointError, ConfigError)


if __name__ == "__main__":
    sys.exit(main())
