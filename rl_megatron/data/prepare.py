"""Write training data as parquet files in verl's layout: `python -m rl_megatron.data.prepare {countdown,gsm8k,math}`.

Nothing is downloaded: countdown problems are generated here, GSM8K and MATH are converted from a local copy.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from rl_megatron.errors import ConfigError, one_line
from rl_megatron.data.countdown import TEMPLATES, countdown_rows, generate_countdown_problems
from rl_megatron.data.parquet_files import DataFileError, check_data_file
from rl_megatron.rewards.gsm8k import extract_answer as gsm8k_final_answer
from rl_megatron.rewards.math import last_boxed_answer

GSM8K_SOURCE = "openai/gsm8k"  # data_source names the reward functions are registered under (rl_megatron/rewards)
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
GSM8K_INSTRUCTION = 'Let\'s think step by step, and write the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step, and write the final answer within \\boxed{}."

EPILOG = """\
examples:
  python -m rl_megatron.data.prepare countdown --out data/countdown
  python -m rl_megatron.data.prepare countdown --out data/countdown --num-samples 1000 --num-operands 4 \\
      --template qwen-instruct --test-size 100
  python -m rl_megatron.data.prepare gsm8k --input gsm8k/main/test-00000-of-00001.parquet --out data/gsm8k
  python -m rl_megatron.data.prepare math --input MATH/train.jsonl --out data/math --split train

then train on them with
  data.train_files=[data/countdown/train.parquet] data.val_files=[data/countdown/test.parquet] data.task=null
(countdown prompts are already templated; data.apply_chat_template only affects message-list prompts.)
"""


def write_rows(rows: list[dict], path: str) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path)
    print(f"wrote {path} ({len(rows)} rows)", flush=True)


def prepare_countdown(args) -> None:
    low, high = args.num_operands
    operand_counts = list(range(low, high + 1))
    print(f"generating {args.num_samples} train + {args.test_size} test countdown problems ({low}..{high} numbers in "
          f"1..{args.max_number}, targets in 1..{args.max_target}, seed {args.seed}, template {args.template})",
          flush=True)
    problems = generate_countdown_problems(args.num_samples + args.test_size, operand_counts, args.seed,
                                           args.max_number, args.max_target)
    # The test split comes first so that a larger --num-samples keeps the same test problems.
    test, train = problems[:args.test_size], problems[args.test_size:]
    os.makedirs(args.out, exist_ok=True)
    write_rows(countdown_rows(train, args.template, "train"), os.path.join(args.out, "train.parquet"))
    if test:
        write_rows(countdown_rows(test, args.template, "test"), os.path.join(args.out, "test.parquet"))


def read_records(path: str) -> list[dict]:
    """The records of a .jsonl (one JSON object a line) or .parquet file."""
    check_data_file(path, "--input")
    if path.endswith(".parquet"):
        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as err:
            raise DataFileError("--input", path, f"is not a readable parquet file ({one_line(err)})",
                                "Pass the dataset's .parquet or .jsonl file.") from None
    if not path.endswith((".jsonl", ".json")):
        raise DataFileError("--input", path, "is neither .jsonl nor .parquet", "Pass the dataset as one of those.")
    records = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFileError("--input", path, f"line {line_number + 1} is not JSON ({err.msg}, column "
                                    f"{err.colno})", "Fix that line; the file needs one JSON object a line.",
                                    row=len(records)) from None
            if not isinstance(record, dict):
                raise DataFileError("--input", path, f"line {line_number + 1} holds a {type(record).__name__}",
                                    "Each line must be one JSON object.", row=len(records))
            records.append(record)
    return records


def text_field(path: str, record: dict, row: int, column: str) -> str:
    value = record.get(column)
    if not isinstance(value, str):
        problem = "is missing" if column not in record else f"holds {value!r:.60} instead of text"
        raise DataFileError("--input", path, problem, f"Pass the dataset with the Hugging Face columns "
                            f"(its rows have: {', '.join(record)}).", row=row, column=column)
    return value


def split_name(args) -> str:
    """--split, or the split the input's file name shows (train / test)."""
    if args.split:
        return args.split
    name = os.path.basename(args.input).lower()
    found = [split for split in ("train", "test") if split in name]
    if len(found) != 1:
        raise ConfigError(f"cannot tell the split of --input {args.input} from its name: pass --split train or "
                          "--split test.")
    return found[0]


def prepare_math_dataset(args, question_column: str, answer_column: str, reference_answer, instruction: str,
                         data_source: str) -> None:
    """Shared by gsm8k and math: a user message of question + instruction, the reference's final answer as the
    ground truth; rows whose reference has no final answer are skipped and counted."""
    records = read_records(args.input)
    split = split_name(args)
    print(f"converting {len(records)} {args.command} records of {args.input} ({split} split)", flush=True)
    rows, skipped = [], 0
    for row, record in enumerate(records):
        question = text_field(args.input, record, row, question_column)
        answer = reference_answer(text_field(args.input, record, row, answer_column))
        if answer is None:
            skipped += 1
            continue
        rows.append({
            "data_source": data_source,
            "prompt": [{"role": "user", "content": f"{question} {instruction}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": row, "question": question,
                           answer_column: record[answer_column]},
        })
    if skipped:
        print(f"skipped {skipped} records whose {answer_column} has no final answer", flush=True)
    if not rows:
        raise DataFileError("--input", args.input, f"no record has a final answer in its {answer_column}",
                            "Pass the GSM8K / MATH file itself.", column=answer_column)
    os.makedirs(args.out, exist_ok=True)
    write_rows(rows, os.path.join(args.out, f"{split}.parquet"))


def operand_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("..")
    try:
        low, high = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or LOW..HIGH, e.g. 4 or 3..4") from None
    if not 2 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: need 2 <= LOW <= HIGH")
    return low, high


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rl_megatron.data.prepare", description=__doc__,
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{countdown,gsm8k,math}")
    countdown = commands.add_parser(
        "countdown", help="generate solvable countdown problems (TinyZero's task): OUT/train.parquet, test.parquet",
        description="Generate countdown problems, each solvable: the target is the value of a random expression "
                    "using every number once. Writes OUT/train.parquet and OUT/test.parquet (data_source "
                    "'countdown', ground truth {target, numbers}).")
    countdown.add_argument("--out", required=True, help="output folder")
    countdown.add_argument("--num-samples", type=non_negative, default=32768, help="training problems (default 32768)")
    countdown.add_argument("--test-size", type=non_negative, default=1024,
                           help="test problems, distinct from the training ones (default 1024; 0: no test file)")
    countdown.add_argument("--num-operands", type=operand_range, default=(3, 4), metavar="N|LOW..HIGH",
                           help="numbers per problem, drawn uniformly from the range (default 3..4)")
    countdown.add_argument("--max-number", type=int, default=99, help="numbers are drawn from 1..this (default 99)")
    countdown.add_argument("--max-target", type=int, default=100, help="targets lie in 1..this (default 100)")
    countdown.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    countdown.add_argument("--template", choices=list(TEMPLATES), default="base",
                           help="prompt form: 'base' (User:/Assistant: text, for base models) or 'qwen-instruct' "
                                "(<|im_start|> turns) (default base)")
    for name, columns, answer in (("gsm8k", "question, answer", 'after "####" in answer'),
                                  ("math", "problem, solution", "the last \\boxed{} of solution")):
        command = commands.add_parser(
            name, help=f"convert a local {name.upper()} file (.jsonl or .parquet) to OUT/<split>.parquet",
            description=f"Convert a local copy of the Hugging Face {name.upper()} dataset (columns {columns}; the "
                        f"final answer is {answer}) to OUT/<split>.parquet with a chat-message prompt.")
        command.add_argument("--input", required=True, help="the dataset file: .jsonl or .parquet")
        command.add_argument("--out", required=True, help="output folder")
        command.add_argument("--split", choices=("train", "test"),
                             help="the split it holds (default: from the input's file name)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "countdown":
            prepare_countdown(args)
        elif args.command == "gsm8k":
            prepare_math_dataset(args, "question", "answer", gsm8k_final_answer, GSM8K_INSTRUCTION, GSM8K_SOURCE)
        else:
            prepare_math_dataset(args, "problem", "solution", last_boxed_answer, MATH_INSTRUCTION, MATH_SOURCE)
    except (ConfigError, ValueError, OSError) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
