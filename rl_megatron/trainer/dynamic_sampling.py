"""DAPO's dynamic sampling (Yu et al., 2025; `algorithm.filter_groups`): a prompt whose samples all score the same
gives GRPO no signal (every advantage is 0), so its group is dropped and more prompts are generated until the step
has data.train_batch_size groups that do vary.

    round 1, 2, ...: generate data.gen_batch_size prompts x rollout.n -> score -> keep the groups whose metric varies
    enough kept:     the first data.train_batch_size of them are trained on; the surplus is dropped (its prompts are
                     used up: the data position, and so a resumed run, moves past them)
    cap reached:     (max_num_gen_batches rounds) on_cap=stop raises; on_cap=train trains on the groups kept, padded
                     with dropped groups up to whole mini-batches (actor.ppo_mini_batch_size prompts)

The padding keeps the batch splitting evenly over every data-parallel rank and micro-batch as the pre-flight check
planned (a batch of another size hangs collective calls: verl#5228). Padding groups join no loss (their loss masks are
zeroed); with no group kept at all the step's update is skipped (a mini-batch without tokens takes no optimizer step).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from rl_megatron.batch import Sample
from rl_megatron.errors import ConfigError
from rl_megatron.trainer.rewards import Rewards


def varied_groups(values: Tensor, n: int) -> list[bool]:
    """For each group of `n` consecutive samples: whether `values` differ within it (a lone sample never varies)."""
    groups = values.reshape(-1, n)
    return (groups.max(dim=1).values > groups.min(dim=1).values).tolist()


@dataclass
class Filled:
    """A step's batch from dynamic sampling: whole prompt groups, in generation order, and their rewards."""
    samples: list[Sample]
    rewards: Rewards
    metrics: dict[str, float]


@dataclass(frozen=True)
class GroupFilter:
    n: int  # samples per prompt (rollout.n)
    train_groups: int  # groups a step trains on (data.train_batch_size)
    mini_batch_groups: int  # groups per optimizer step (actor.ppo_mini_batch_size)
    metric: str  # "acc" or "score": what must vary within a kept group
    max_rounds: int  # generation rounds before on_cap applies (0: no limit)
    on_cap: str  # "train" or "stop"

    @classmethod
    def of(cls, cfg) -> GroupFilter | None:
        """The filter a Config asks for (None when algorithm.filter_groups.enable is off)."""
        f = cfg.algorithm.filter_groups
        if not f.enable:
            return None
        return cls(cfg.rollout.n, cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, f.metric,
                   f.max_num_gen_batches, f.on_cap)

    def cap_note(self, step: int, filled: Filled) -> str | None:
        """What the run's log says of step `step` when `filled` reached the cap (None when it did not)."""
        if not filled.metrics["filter/reached_cap"]:
            return None
        return (f"step {step}: dynamic sampling kept {filled.metrics['filter/kept_groups']} of {self.train_groups} "
                f"groups in algorithm.filter_groups.max_num_gen_batches={self.max_rounds} rounds; training on them "
                f"with {filled.metrics['filter/padded_groups']} padding groups (kept out of the loss)")

    def fill(self, generate: Callable[[int], list[Sample]],
             score: Callable[[list[Sample], int], Rewards]) -> Filled:
        """Generate (`generate(round)`, round 1, 2, ...) and score (`score(samples, round)`) rounds until enough
        groups vary, or the cap."""
        samples: list[Sample] = []
        rewards: list[Rewards] = []
        kept: list[int] = []  # group indices over all rounds
        rounds = 0
        while len(kept) < self.train_groups and not (self.max_rounds and rounds == self.max_rounds):
            rounds += 1
            new = generate(rounds)
            new_rewards = score(new, rounds)
            first_group = len(samples) // self.n
            kept += [first_group + g for g, varies in enumerate(varied_groups(self.values(new_rewards), self.n))
                     if varies]
            samples += new
            rewards.append(new_rewards)
        generated_groups = len(samples) // self.n
        all_rewards = Rewards.cat(rewards)
        metrics = {"filter/gen_batches": rounds, "filter/prompts_used": generated_groups,
                   "filter/kept_groups": min(len(kept), self.train_groups),
                   "filter/generated_reward/mean": all_rewards.scores.mean().item(),
                   "filter/generated_acc/mean": all_rewards.acc.mean().item()}
        padding: list[int] = []
        if len(kept) < self.train_groups:  # the cap was reached
            if self.on_cap == "stop":
                raise self.cap_error(len(kept), generated_groups)
            wanted = self.padded_size(len(kept))
            dropped = sorted(set(range(generated_groups)) - set(kept))
            padding = dropped[:wanted - len(kept)]
        metrics |= {"filter/reached_cap": float(len(kept) < self.train_groups), "filter/padded_groups": len(padding)}
        groups = kept[:self.train_groups] + padding
        indices = [g * self.n + i for g in groups for i in range(self.n)]
        for g in padding:
            for sample in samples[g * self.n:(g + 1) * self.n]:
                sample.loss_mask = [0] * len(sample.response_ids)
        return Filled([samples[i] for i in indices], all_rewards.select(indices), metrics)

    def values(self, rewards: Rewards) -> Tensor:
        """What must vary within a kept group."""
        return rewards.acc if self.metric == "acc" else rewards.scores

    def varies(self, rewards: Rewards) -> bool:
        """Whether one group (its `n` samples' rewards) is kept."""
        return varied_groups(self.values(rewards), self.n)[0]

    def padded_size(self, kept: int) -> int:
        """The groups of a batch cut short by the cap, padded: up to whole mini-batches (one, when none was kept)."""
        return max(self.mini_batch_groups, -(-kept // self.mini_batch_groups) * self.mini_batch_groups)

    def cap_error(self, kept: int, generated_groups: int) -> ConfigError:
        return ConfigError(
            f"Dynamic sampling found {kept} of the {self.train_groups} prompt groups a step trains on "
            f"(data.train_batch_size) whose samples' {self.metric} varies, in algorithm.filter_groups."
            f"max_num_gen_batches={self.max_rounds} rounds ({generated_groups} prompts): the data is too easy "
            "or too hard for the policy. Raise max_num_gen_batches (0: no limit), set "
            "algorithm.filter_groups.on_cap=train to train on what is kept, or change the data.")
