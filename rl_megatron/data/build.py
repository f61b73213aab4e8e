"""The one place the trainer gets its prompts from: a built-in task or parquet files, per the `data` config."""
from __future__ import annotations

from rl_megatron.data import TASKS
from rl_megatron.data.loader import PromptLoader
from rl_megatron.data.parquet_files import files_fingerprint, read_prompt_rows
from rl_megatron.data.section import resolve_data_section
from rl_megatron.errors import ConfigError

SPLITS = ("train", "val")


def build_prompt_loader(data_cfg, tokenizer, seed: int, split: str = "train",
                        tools: list[dict] | None = None) -> PromptLoader:
    """The loader of `split`: "train" serves endless shuffled batches of data.train_batch_size prompts from
    data.train_files (or the built-in data.task when no files are set); "val" serves data.val_files (or the task's
    prompts) in file order, data.val_batch_size prompts at a time (all of them by default). `data_cfg` may be as
    written (one path for a file list, no task); its files are checked as they are read. `tools`: function schemas
    the chat template shows the model (multi-turn tool use). Raises ConfigError naming the key to fix."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {', '.join(SPLITS)}")
    data_cfg = resolve_data_section(data_cfg)
    files_key = f"data.{split}_files"
    paths = getattr(data_cfg, f"{split}_files")
    if paths:
        source = f"{files_key}=[{', '.join(paths)}]"
        rows = read_prompt_rows(paths, files_key)
        fingerprint = files_fingerprint(paths)
    elif data_cfg.task is not None:
        # A built-in toy task has no held-out problems: it validates on its training prompts, in order.
        source = f"data.task={data_cfg.task}" + ("" if split == "train" else " (its training prompts)")
        rows = TASKS[data_cfg.task]()
        fingerprint = f"task:{data_cfg.task}"
    else:
        raise ConfigError("data.val_files is empty: set it to the parquet files to validate on.")
    batch_size = (data_cfg.gen_batch_size or data_cfg.train_batch_size) if split == "train" else data_cfg.val_batch_size
    try:
        loader = PromptLoader(rows, tokenizer, batch_size, data_cfg.max_prompt_length, seed,
                              use_chat_template=data_cfg.apply_chat_template, shuffle=split == "train",
                              fingerprint=fingerprint, tools=tools)
    except ValueError as err:
        raise ConfigError(f"{source}: {err}") from None
    print(f"data ({split}): {len(loader.rows)} prompts from {source}; {loader.dropped} longer than "
          f"data.max_prompt_length={data_cfg.max_prompt_length} tokens dropped", flush=True)
    return loader

