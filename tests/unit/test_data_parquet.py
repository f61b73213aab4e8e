"""Parquet prompt files in verl's layout: reading, chat templates, filtering, resuming, and malformed files."""
import os
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.runs import REPO
from transformers import AutoTokenizer

from rl_megatron.config import ConfigError
from rl_megatron.preflight import load_config
from rl_megatron.config.schema import DataConfig
from rl_megatron.data.build import build_prompt_loader
from rl_megatron.data.section import check_data_section, resolve_data_section
from rl_megatron.data.parquet_files import DataFileError

CONFIGS = os.path.join(REPO, "configs")
TINY_MODEL_DIR = os.path.join(CONFIGS, "models", "tiny-qwen2-digits")
DEMO_CONFIG = os.path.join(CONFIGS, "demo_cpu.yaml")
# BOS, the messages' contents, and "=" as the generation prompt: "3+4" renders as the raw prompt "3+4=" would.
DIGIT_CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
                       "{% if add_generation_prompt %}={% endif %}")
BOS, PLUS, EQUALS = 1, 14, 16


def digit_ids(text):
    return [BOS] + [{"+": PLUS, "=": EQUALS}.get(c, int(c) + 4 if c.isdigit() else None) for c in text]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR)


@pytest.fixture(scope="module")
def chat_tokenizer():
    chat = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    chat.chat_template = DIGIT_CHAT_TEMPLATE
    return chat


def sum_rows(pairs, as_messages=True):
    """verl-layout rows asking for a + b, with TinyZero-style dict ground truths and extra_info."""
    return [{
        "data_source": "countdown",
        "prompt": [{"role": "user", "content": f"{a}+{b}"}] if as_messages else f"{a}+{b}=",
        "reward_model": {"style": "rule", "ground_truth": {"target": a + b, "numbers": [a, b]}},
        "extra_info": {"index": index, "split": "train"},
    } for index, (a, b) in enumerate(pairs)]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def data_config(**keys):
    return DataConfig(**{"train_batch_size": 4, "max_prompt_length": 8, **keys})


PAIRS = [(a, b) for a in range(4) for b in range(3)]  # 12 rows


def test_message_prompts_go_through_the_chat_template_and_rows_keep_their_fields(tmp_path, chat_tokenizer, capsys):
    path = write_parquet(tmp_path / "train.parquet", sum_rows(PAIRS))
    loader = build_prompt_loader(data_config(train_files=[path], train_batch_size=12), chat_tokenizer, seed=0)
    batch = loader.next_batch()
    assert sorted(tuple(p.ids) for p in batch) == sorted(tuple(digit_ids(f"{a}+{b}=")) for a, b in PAIRS)
    for ids, truth, info, source in ((p.ids, p.ground_truth, p.extra_info, p.data_source) for p in batch):
        a, b = ids[1] - 4, ids[3] - 4  # one BOS only: the template's, not a second from the tokenizer
        assert truth == {"target": a + b, "numbers": [a, b]}
        assert info == {"index": PAIRS.index((a, b)), "split": "train"}
        assert source == "countdown"
    assert f"data (train): 12 prompts from data.train_files=[{path}]; 0 longer" in capsys.readouterr().out


def test_plain_string_prompts_are_raw_text(tmp_path, chat_tokenizer):
    path = write_parquet(tmp_path / "train.parquet", sum_rows(PAIRS, as_messages=False))
    loader = build_prompt_loader(data_config(train_files=path, train_batch_size=12), chat_tokenizer, seed=0)
    assert sorted(map(tuple, loader.prompt_ids)) == sorted(tuple(digit_ids(f"{a}+{b}=")) for a, b in PAIRS)


def test_raw_switch_uses_the_messages_text_and_no_template_is_an_error(tmp_path, tokenizer):
    rows = sum_rows(PAIRS)
    rows[0]["prompt"] = [{"role": "system", "content": "1"}, {"role": "user", "content": "2+3="}]
    path = write_parquet(tmp_path / "train.parquet", rows)
    loader = build_prompt_loader(data_config(train_files=[path], apply_chat_template=False), tokenizer, seed=0)
    # "1\n2+3=" as raw text: BOS from the tokenizer, no template; the tiny vocabulary has no newline token.
    assert loader.prompt_ids[0] == [BOS, 5, 6, PLUS, 7, EQUALS]
    with pytest.raises(ConfigError, match=r"data.train_files=\[.*no chat template.*data.apply_chat_template=false"):
        build_prompt_loader(data_config(train_files=[path]), tokenizer, seed=0)


def test_long_prompts_are_dropped_counted_and_logged(tmp_path, chat_tokenizer, capsys):
    rows = sum_rows(PAIRS)
    rows[5]["prompt"] = [{"role": "user", "content": "12345+678"}]  # 11 tokens with BOS and "="
    path = write_parquet(tmp_path / "train.parquet", rows)
    loader = build_prompt_loader(data_config(train_files=[path]), chat_tokenizer, seed=0)
    assert loader.dropped == 1 and len(loader.rows) == 11
    assert rows[5]["extra_info"] not in [row["extra_info"] for row in loader.rows]
    out = capsys.readouterr().out
    assert "11 prompts from data.train_files" in out and "1 longer than data.max_prompt_length=8 tokens dropped" in out


def test_files_are_read_in_order_and_validation_is_unshuffled(tmp_path, chat_tokenizer):
    first = write_parquet(tmp_path / "a.parquet", sum_rows(PAIRS[:5]))
    second = write_parquet(tmp_path / "b.parquet", sum_rows(PAIRS[5:]))
    cfg = data_config(val_files=[first, second])
    loader = build_prompt_loader(cfg, chat_tokenizer, seed=3, split="val")
    batch = loader.next_batch()
    assert [p.ids for p in batch] == [digit_ids(f"{a}+{b}=") for a, b in PAIRS]
    assert loader.next_batch() == batch  # all of it, every time
    loader = build_prompt_loader(replace(cfg, val_batch_size=5), chat_tokenizer, seed=3, split="val")
    assert [len(loader.next_batch()) for _ in range(3)] == [5, 5, 5]
    with pytest.raises(ConfigError, match="data.val_files is empty"):
        build_prompt_loader(data_config(train_files=[first]), chat_tokenizer, seed=0, split="val")
    # A built-in task validates on its own prompts, in order.
    task = build_prompt_loader(data_config(task="arithmetic"), chat_tokenizer, seed=0, split="val").next_batch()
    assert [p.ids for p in task] == [p.ids for p in build_prompt_loader(
        data_config(task="arithmetic"), chat_tokenizer, seed=1, split="val").next_batch()]
    assert len(task) == 55


def test_training_order_is_seeded_and_resumes_exactly_over_the_same_files(tmp_path, chat_tokenizer):
    path = write_parquet(tmp_path / "train.parquet", sum_rows(PAIRS))
    cfg = data_config(train_files=[path], train_batch_size=5)

    def batches(loader, count):
        return [[p.ids for p in loader.next_batch()] for _ in range(count)]

    loader = build_prompt_loader(cfg, chat_tokenizer, seed=0)
    assert batches(loader, 3) != batches(build_prompt_loader(cfg, chat_tokenizer, seed=1), 3)
    state = loader.state_dict()
    assert (state["epoch"], state["offset"]) == (1, 3)  # 15 prompts served from 12 rows
    expected = batches(loader, 4)

    resumed = build_prompt_loader(cfg, chat_tokenizer, seed=0)
    resumed.load_state_dict(state)
    assert batches(resumed, 4) == expected

    changed = sum_rows(PAIRS)
    changed[0]["extra_info"]["split"] = "edited"  # same rows, same prompts: still other data
    write_parquet(tmp_path / "train.parquet", changed)
    with pytest.raises(ValueError, match="same data files"):
        build_prompt_loader(cfg, chat_tokenizer, seed=0).load_state_dict(state)


def malformed_cases(tmp_path):
    """(file, the row and column the message must name, a fragment of the problem) per malformed file."""
    rows = sum_rows(PAIRS[:4])

    def without(column):
        return [{k: v for k, v in row.items() if k != column} for row in rows]

    def changed(index, column, value):
        edited = [dict(row) for row in rows]
        edited[index][column] = value
        return edited

    cases = {
        "missing_prompt": (without("prompt"), None, "prompt", "has no column 'prompt'"),
        "missing_ground_truth": ([{**row, "reward_model": {"style": "rule"}} for row in rows], None,
                                 "reward_model.ground_truth", "no field 'ground_truth'"),
        "source_not_text": ([{**row, "data_source": 7} for row in rows], 0, "data_source", "int values"),
        "prompt_list_of_text": ([{**row, "prompt": ["1+2"]} for row in rows], 0, "prompt", "not lists of"),
        "ground_truth_null": (changed(2, "reward_model", {"style": "rule", "ground_truth": None}), 2,
                              "reward_model.ground_truth", "null"),
        "source_null": (changed(1, "data_source", None), 1, "data_source", "None"),
        "empty_prompt": (changed(3, "prompt", []), 3, "prompt", "the prompt is []"),
        "content_null": (changed(2, "prompt", [{"role": "user", "content": None}]), 2, "prompt[0].content",
                         "content=None"),
    }
    made = {name: (write_parquet(tmp_path / f"{name}.parquet", file_rows), row, column, problem)
            for name, (file_rows, row, column, problem) in cases.items()}
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "text.parquet").write_text("data_source,prompt\ncountdown,1+2\n")
    pq.write_table(pa.Table.from_pylist(rows).slice(0, 0), tmp_path / "no_rows.parquet")
    made.update({
        "empty_file": (str(tmp_path / "empty.parquet"), None, None, "is empty (0 bytes)"),
        "not_parquet": (str(tmp_path / "text.parquet"), None, None, "not a readable parquet file"),
        "no_rows": (str(tmp_path / "no_rows.parquet"), None, None, "has no rows"),
        "missing_path": (str(tmp_path / "absent.parquet"), None, None, "does not exist"),
        "folder": (str(tmp_path), None, None, "is not a file"),
    })
    return made


CASES = ["missing_prompt", "missing_ground_truth", "source_not_text", "prompt_list_of_text", "ground_truth_null",
         "source_null", "empty_prompt", "content_null", "empty_file", "not_parquet", "no_rows", "missing_path",
         "folder"]


@pytest.mark.parametrize("case", CASES)
def test_malformed_files_fail_at_load_naming_file_row_and_column(tmp_path, chat_tokenizer, case):
    good = write_parquet(tmp_path / "good.parquet", sum_rows(PAIRS))
    path, row, column, problem = malformed_cases(tmp_path)[case]
    with pytest.raises(DataFileError) as caught:
        build_prompt_loader(data_config(train_files=[good, path]), chat_tokenizer, seed=0)
    message, error = str(caught.value), caught.value
    assert message.startswith(f"data.train_files[1]: file '{path}'") and problem in message
    assert (error.path, error.row, error.column) == (path, row, column)
    if row is not None:
        assert f"row {row} (0-based)" in message
    if column is not None:
        assert f"column '{column}'" in message
    assert isinstance(error, ConfigError)  # reported by the CLI as one `error:` line


def test_task_and_train_files_exclude_each_other(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", sum_rows(PAIRS))
    cfg = resolve_data_section(data_config(train_files=path))  # one path, as verl's command lines give it
    check_data_section(cfg)
    assert cfg.train_files == [path] and cfg.task is None and cfg.val_files == []
    cfg = resolve_data_section(data_config())
    check_data_section(cfg)
    assert cfg.task == "arithmetic"  # the built-in default when no files are given
    with pytest.raises(ConfigError, match="data.task='arithmetic' and data.train_files are both set.*data.task=null"):
        check_data_section(resolve_data_section(data_config(task="arithmetic", train_files=[path])))
    with pytest.raises(ConfigError, match=r"data.train_files=\{'a': 1\} must be a list"):
        resolve_data_section(data_config(train_files={"a": 1}))


def test_config_keys_are_checked_when_the_config_loads(tmp_path):
    # Plain-text prompts: the demo's tokenizer has no chat template (the pre-flight check encodes the first prompt).
    path = write_parquet(tmp_path / "train.parquet", sum_rows(PAIRS, as_messages=False))
    cfg = load_config(DEMO_CONFIG, ["data.task=null", f"data.train_files=[{path}]",
                                                f"data.val_files={path}"])
    assert (cfg.data.train_files, cfg.data.val_files, cfg.data.task) == ([path], [path], None)
    with pytest.raises(DataFileError, match=r"data.val_files\[1\]: file 'missing.parquet': does not exist"):
        load_config(DEMO_CONFIG, [f"data.val_files=[{path}, missing.parquet]"])
    with pytest.raises(ConfigError, match="both set"):
        load_config(DEMO_CONFIG, [f"data.train_files=[{path}]"])  # the demo's data.task: arithmetic
    with pytest.raises(ConfigError, match="data.val_batch_size=0"):
        load_config(DEMO_CONFIG, ["data.val_batch_size=0"])
    # Validating needs data.val_files beside data.train_files (a built-in task validates on its own prompts).
    for asked in ("trainer.val_only=true", "trainer.val_every=2"):
        with pytest.raises(ConfigError, match=rf"{asked} .*validate on data.val_files, which is empty"):
            load_config(DEMO_CONFIG, ["data.task=null", f"data.train_files=[{path}]", asked])
    assert load_config(DEMO_CONFIG, ["trainer.val_only=true"]).trainer.val_only
