"""Which decoder layers each pipeline stage holds, as Megatron-core 0.16.1 builds them
(transformer_block.get_num_layers_to_build, transformer_layer.get_transformer_layer_offset).

Even stages hold layers / PP each. Uneven ones (actor.num_layers_in_first_pipeline_stage and / or
actor.num_layers_in_last_pipeline_stage, Megatron's fields of the same names): the first and / or last stage hold
that many and the stages between share the rest evenly: DeepSeek-V3's 61 layers (a prime) at PP=16 as 15 stages
of 4 and a last stage of 1, or a first stage lightened because it also holds the embedding. With VPP model chunks
per stage, every stage's layers are cut into VPP equal chunks, and chunk v of every stage comes before chunk v + 1
of any: chunk v of stage s starts at v x (layers / VPP) plus the chunk sizes of the stages before s.

Megatron refuses, in TransformerConfig.__post_init__ (in a worker, after Ray started), what `check_split` refuses
before anything starts, naming the config keys: a count below 1; stages between the first and last that cannot take
equal whole shares of at least one layer (with both set at PP=2 there are none: first + last must be every layer);
with VPP, a stage's count that VPP does not divide. Uneven stages need PP > 1 (one stage is first and last at once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_megatron.config.schema import Config
from rl_megatron.errors import ConfigError
from rl_megatron.roles import Role

FIRST_KEY = "actor.num_layers_in_first_pipeline_stage"
LAST_KEY = "actor.num_layers_in_last_pipeline_stage"
SUGGESTIONS = 3  # valid settings named when a split is refused


@dataclass(frozen=True)
class StageLayers:
    """Layers on the first and on the last pipeline stage (None: an even share, Megatron's default)."""
    first: Optional[int] = None
    last: Optional[int] = None

    @classmethod
    def of_role(cls, cfg: Config, role: Role) -> StageLayers:
        """The actor's keys for the roles in the actor's processes (the actor, and a colocated reference or critic,
        which share its pipeline); a separately placed role, and a model of its own (the teacher's: other layers),
        splits its own pipeline evenly."""
        section = cfg.actor if role is Role.ACTOR else getattr(cfg, str(role))
        if role is not Role.ACTOR and (section.placement == "separate" or role.own_model):
            return cls()
        return cls(cfg.actor.num_layers_in_first_pipeline_stage, cfg.actor.num_layers_in_last_pipeline_stage)

    def transformer_config_fields(self) -> dict:
        return dict(num_layers_in_first_pipeline_stage=self.first, num_layers_in_last_pipeline_stage=self.last)


@dataclass(frozen=True)
class PipelineSplit:
    """A model's `layers` over `pp` stages of `vpp` model chunks each (a split `check_split` accepts)."""
    layers: int
    pp: int = 1
    vpp: int = 1
    stages: StageLayers = StageLayers()

    def stage_sizes(self) -> list[int]:
        """The layer count of each stage, first to last."""
        first, last = self.stages.first, self.stages.last
        middle_stages = self.pp - (first is not None) - (last is not None)
        share = (self.layers - (first or 0) - (last or 0)) // middle_stages if middle_stages else 0
        sizes = [share] * self.pp
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
        return sizes

    def chunks(self, stage: int) -> list[range]:
        """The global indices of the layers of each model chunk of `stage`, in chunk order."""
        chunk_sizes = [size // self.vpp for size in self.stage_sizes()]
        per_round, start = sum(chunk_sizes), sum(chunk_sizes[:stage])
        return [range(v * per_round + start, v * per_round + start + chunk_sizes[stage]) for v in range(self.vpp)]

    def stage_layers(self, stage: int) -> list[int]:
        return [layer for chunk in self.chunks(stage) for layer in chunk]

    def chunk_sizes(self) -> list[int]:
        """The distinct layer counts of a model chunk over the stages, smallest first."""
        return sorted({size // self.vpp for size in self.stage_sizes()})


def split_problem(layers: int, pp: int, vpp: int, first: Optional[int], last: Optional[int]) -> Optional[str]:
    """What Megatron would refuse in this split (None: nothing), in words without config keys."""
    if first is None and last is None:
        return None if layers % (pp * vpp) == 0 else "uneven"
    if pp == 1:
        return "one stage"
    for count in (first, last):
        if count is not None and count % vpp:
            return "vpp"
    middle_stages = pp - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    if middle_stages == 0:
        # Megatron-core 0.16.1's interleaved layer offset divides by the count of middle stages.
        return "no middle" if rest else "interleaved without middle" if vpp > 1 else None
    if rest < middle_stages or rest % middle_stages or (rest // middle_stages) % vpp:
        return "middle"
    return None


def _valid_settings(layers: int, pp: int, vpp: int, first: Optional[int], last: Optional[int]) -> list[tuple]:
    """Splits that work, nearest first: the keys set now changed (both tried one at a time when neither is)."""
    if first is None and last is None:
        candidates = [(f, None) for f in range(1, layers)] + [(None, l) for l in range(1, layers)]
    else:
        firsts = range(1, layers) if first is not None else [None]
        candidates = [(f, l) for f in firsts for l in (range(1, layers) if last is not None else [None])]
    valid = [c for c in candidates if split_problem(layers, pp, vpp, *c) is None]

    def distance(candidate):  # to the values set now; with neither set, to an even share
        target = (first or layers // pp, last or layers // pp)
        return sum(abs(v - t) for v, t in zip(candidate, target) if v is not None)
    return sorted(valid, key=distance)[:SUGGESTIONS]


def _describe(setting: tuple, layers: int, pp: int, first_key: str, last_key: str) -> str:
    first, last = setting
    sizes = PipelineSplit(layers, pp, stages=StageLayers(first, last)).stage_sizes()
    keys = " ".join(f"{key}={value}" for key, value in ((first_key, first), (last_key, last)) if value is not None)
    return f"{keys} ({'+'.join(stage_runs(sizes))} layers)"


def stage_runs(sizes: list[int]) -> list[str]:
    """Stage sizes written compactly: [4, 4, 4, 1] as ['3x4', '1']."""
    runs: list[list[int]] = []
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return [f"{count}x{size}" if count > 1 else str(size) for size, count in runs]


def check_split(layers: int, pp: tuple[str, int], vpp: tuple[str, int], first: tuple[str, Optional[int]] | None,
                last: tuple[str, Optional[int]] | None, source: str) -> None:
    """A model's `layers` (read from `source`) over PP stages of VPP chunks, with the first / last stage's counts
    where set; each size comes with the key that sets it (first / last None: a caller without those keys, such as
    the convert CLI). ConfigError naming the keys and valid values."""
    (pp_key, pp_size), (vpp_key, vpp_size) = pp, vpp
    first_key, first_count = first or (FIRST_KEY, None)
    last_key, last_count = last or (LAST_KEY, None)
    problem = split_problem(layers, pp_size, vpp_size, first_count, last_count)
    if problem is None:
        return
    sizes = f"{pp_key}={pp_size}" + (f" x {vpp_key}={vpp_size}" if vpp_size > 1 else "")
    set_now = " and ".join(f"{key}={value}" for key, value in ((first_key, first_count), (last_key, last_count))
                           if value is not None)
    options = [_describe(s, layers, pp_size, first_key, last_key)
               for s in _valid_settings(layers, pp_size, vpp_size, first_count, last_count)]
    suggestion = f" Valid: {'; '.join(options)}." if options else ""
    if problem == "uneven":
        hint = (f" Or give the first or last stage its own layer count (Megatron's uneven pipeline).{suggestion}"
                if first is not None and options else "")
        raise ConfigError(f"{sizes} must divide the model's {layers} layers ({source}). Choose sizes whose product "
                          f"divides the layer count.{hint}")
    if problem == "one stage":
        raise ConfigError(f"{set_now} shapes the first / last pipeline stage, but {pp_key}=1 has one stage only. Set "
                          f"{pp_key} > 1, or remove it.")
    if problem == "vpp":
        raise ConfigError(f"{set_now}: each stage's layers split into {vpp_key}={vpp_size} model chunks, so the "
                          f"first and last stage's counts must be multiples of {vpp_size}.{suggestion}")
    middle_stages = pp_size - (first_count is not None) - (last_count is not None)
    rest = layers - (first_count or 0) - (last_count or 0)
    if problem == "no middle":
        raise ConfigError(f"{set_now} at {pp_key}={pp_size} leave no stage between the first and last, so they must "
                          f"add up to the model's {layers} layers ({source}), not {layers - rest}.{suggestion}")
    if problem == "interleaved without middle":
        raise ConfigError(f"{set_now} at {pp_key}={pp_size} x {vpp_key}={vpp_size}: Megatron-core cannot interleave "
                          f"a pipeline whose first and last stages are both set and no stage lies between them (a "
                          f"division by zero in its layer offsets). Set {first_key} alone: the last stage then holds "
                          f"the other {layers - first_count} layers.")
    each = f" of a multiple of {vpp_key}={vpp_size} layers" if vpp_size > 1 else " of at least one layer"
    raise ConfigError(f"{set_now} leave {rest} of the model's {layers} layers ({source}) to the {middle_stages} "
                      f"stage(s) between the first and last ({pp_key}={pp_size}), which Megatron gives equal shares"
                      f"{each}; {rest} does not split so.{suggestion}")
