"""The cluster plan: roles -> nodes, parallel layouts and memory per GPU, from the config and the model's config.json
alone. The launcher prints it (`launch/train_3d.sh --dry-run`), the trainer at start, and the pre-flight checks and
the doctor read it."""
from rl_megatron.planning.plan import ClusterPlan, build_plan, format_plan

__all__ = ["ClusterPlan", "build_plan", "format_plan"]
