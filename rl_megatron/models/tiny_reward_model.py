"""Tiny reward models, built locally as the demo's policy is (no download): a sequence classifier with one score
(`*ForSequenceClassification`, num_labels=1) over the digits vocabulary, saved as transformers saves one.

`digits_reward_model` trains one with transformers for the digits demo: a 2-layer Qwen2 classifier regressed onto the
demo's rule (1 for the right answer, 0 otherwise) over every prompt and every one-token response the policy can
sample, the rare right answers weighted up to balance the wrong ones, until every score is within a tolerance of the
rule's (about 150 full-batch steps, ~10-20 s on 2 cores). Its score carries the task's whole signal, so a policy can
learn from it alone (docs/tasks-and-rewards.md, "Reward models"). Texts are scored as the trainer renders a plain
prompt for a reward model: the prompt and the response as text. Usage:
    python -m rl_megatron.models.tiny_reward_model OUT_DIR [--seed N]
"""
import argparse

import torch
import transformers

from rl_megatron.data.arithmetic import arithmetic_rows
from rl_megatron.models.tiny import build_tokenizer, family_config
from rl_megatron.rewards.arithmetic import compute_score


def write_reward_model(folder, family: str = "llama", layers: int = 2, seed: int = 5, **extra) -> str:
    """A random `family` *ForSequenceClassification folder with the digits tokenizer, every weight random (norms
    too, so that a wrong mapping of any shows); `extra`: config fields."""
    config = family_config(family, False, layers, **{"num_labels": 1, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return str(folder)


def digits_reward_model(folder, seed: int = 0, steps: int = 300, tolerance: float = 0.1) -> str:
    """A reward model of the digits demo trained into `folder` (module docstring); AssertionError if it is not
    within `tolerance` of the rule after `steps`."""
    folder = write_reward_model(folder, "qwen2", layers=2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    texts, rule = [], []
    for row in arithmetic_rows():
        for token in range(len(tokenizer)):
            response = tokenizer.decode([token], skip_special_tokens=True)
            texts.append(row["prompt"] + response)
            rule.append(compute_score(response, row["ground_truth"]))
    inputs, target = tokenizer(texts, padding=True, return_tensors="pt"), torch.tensor(rule)
    weights = torch.where(target > 0, (target == 0).sum() / target.sum(), torch.tensor(1.0))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(std=0.05)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(steps):
        scores = model(**inputs).logits[:, 0]
        if (scores - target).abs().max() < tolerance:
            break
        loss = (weights * (scores - target) ** 2).sum() / weights.sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    else:
        raise AssertionError(f"the digits reward model is {(scores - target).abs().max():.3f} off the rule after "
                             f"{steps} steps")
    model.save_pretrained(folder)
    return folder


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Train the digits demo's tiny reward model into a folder "
                                                 "(reward_model.model.path).")
    parser.add_argument("out_dir", help="folder to write (config.json, tokenizer, model.safetensors)")
    parser.add_argument("--seed", type=int, default=0, help="seed of its initial weights")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    print(f"reward model written to {digits_reward_model(args.out_dir, seed=args.seed)}")


if __name__ == "__main__":
    main()
