"""vLLM's CPU backend, adjusted for engines whose weights the trainer writes in place: the linear layers, the MoE
experts and the Gated DeltaNet convolutions keep their parameters (vLLM would repack them for its CPU kernels), and a
sharded engine's shared-memory segments left by a killed run are removed before it starts."""
from __future__ import annotations

import contextlib
import glob
import os

import torch

from rl_megatron.rollout.cpu_gated_delta import run_gated_delta_net_in_torch


def keep_cpu_weights_in_place() -> None:
    """vLLM's CPU backend repacks linear weights into oneDNN / AMX kernel formats after loading and leaves the
    parameters empty, so they could only be updated through a full reload. Instead the parameters keep their
    storage, so that every sync writes them in place, and the kernels read packed copies made from them again after
    any write (`_pack_cpu_linear_from_parameters`). The small GEMMs vLLM gives its SGL kernels (e.g. MoE routers)
    run as plain `F.linear`: that packing would turn a bias the syncs write into float32. Gated DeltaNet layers
    (Qwen3-Next, Qwen3.5) keep their convolution's weight as loaded too, and compute in torch (`cpu_gated_delta.py`).
    (GPU kernels read the parameters as they are.)"""
    from vllm.model_executor.layers import utils

    utils.check_cpu_sgl_kernel = lambda *args, **kwargs: False
    _pack_cpu_linear_from_parameters()
    _pack_cpu_experts_from_parameters()
    run_gated_delta_net_in_torch()


# Linear layers with fewer weights than this run plain `F.linear`. On 2 cores (docs/benchmarks.md, 2026-11-30) a
# oneDNN handler costs at least 0.6 ms to pack (1 ms at 1024 x 512), and up to 256 x 256 weights its product is no
# faster than F.linear's at any batch (16 to 1024 rows; slower below 128); from 384 x 384 on it is faster. An engine
# synced every step repacks each layer every step, which took a tiny model's generation from 0.043 to 0.053 s a step.
ONEDNN_MIN_WEIGHTS = 2**17


def _pack_cpu_linear_from_parameters() -> None:
    """Each linear layer's oneDNN handler (vLLM's fastest CPU GEMM) is packed from its weight parameter, which stays
    as loaded, and packed again at its first use after the parameter changed (torch counts in-place writes in
    `_version`): a weight sync costs one repacking of each layer, at the next generation. Layers too small for
    oneDNN to pay (`ONEDNN_MIN_WEIGHTS`) multiply by their parameter with `F.linear`. Both read the parameters
    through plain aliases (`_plain`)."""
    from vllm.model_executor.layers import utils

    if getattr(utils, "packs_linear_from_parameters", False):  # patched once per process
        return
    dispatch = utils.dispatch_cpu_unquantized_gemm

    def dispatch_keeping_parameters(layer, remove_weight: bool) -> None:
        # Not a linear layer: experts (packed below), or a convolution vLLM would pack in place for its bf16 kernel.
        if layer.weight.ndim != 2:
            return
        # vLLM passes each call the layer's weight, and its bias or None (a row-parallel shard but the first).
        weight, layer_bias = _plain(layer.weight), _plain(getattr(layer, "bias", None))

        def plain_bias(bias):
            return None if bias is None else layer_bias

        if layer.weight.numel() < ONEDNN_MIN_WEIGHTS:
            layer.cpu_linear = lambda x, _, bias: torch.nn.functional.linear(x, weight, plain_bias(bias))
            return
        dispatch(layer, remove_weight=False)
        packed = [weight._version, layer.cpu_linear]

        def linear(x, _, bias):
            if weight._version != packed[0]:
                dispatch(layer, remove_weight=False)
                packed[:] = [weight._version, layer.cpu_linear]
                layer.cpu_linear = linear
            return packed[1](x, weight, plain_bias(bias))

        layer.cpu_linear = linear

    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_parameters
    utils.packs_linear_from_parameters = True


def _plain(param: torch.Tensor | None) -> torch.Tensor | None:
    """`param` as a plain tensor: the same memory and version counter (a sync's in-place writes show in both), but
    without the class of vLLM's parameters, whose Python `__torch_function__` every op taking the parameter and
    every `_version` read would run (15 % of `bench multi_turn --peer vllm`'s serving samples under py-spy).
    The engine's parameters keep their memory for its life: the syncs write into them (`rl_megatron.resharding`)."""
    if param is None:
        return None
    with torch._C.DisableTorchFunctionSubclass():
        return param.detach()


def _pack_cpu_experts_from_parameters() -> None:
    """vLLM's CPU MoE kernel has no path over plain weights: after loading it overwrites the expert parameters
    with a blocked, transposed copy. Instead, the parameters keep the checkpoint layout (so a sync writes them in
    place, and what the engine holds can be compared with the trainer's weights), and the kernel packs them into a
    private copy whenever they changed since it last did (torch counts in-place writes in `_version`). Costs one
    packed copy of the experts' weights."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    if getattr(CPUUnquantizedExperts, "packs_from_parameters", False):  # patched once per process
        return
    apply = CPUUnquantizedExperts.apply

    def keep_parameters(self, layer) -> None:
        self._use_zentorch = False  # zentorch (AMD's kernels) reads the parameters as they are; not installed here
        width = self.moe_config.intermediate_size_per_partition
        if self._padded_intermediate_size(self.moe_config) != width:
            raise ValueError(f"vLLM's CPU MoE kernel needs the experts' width per rollout TP rank ({width}: "
                             f"moe_intermediate_size / rollout.tensor_parallel_size) to be a multiple of "
                             f"{self._intermediate_alignment()}; choose another rollout.tensor_parallel_size.")

    def apply_packed(self, *, w1, w2, **kwargs):
        import vllm._custom_ops as ops

        if getattr(self, "packed_versions", None) != (w1._version, w2._version):
            self.packed = ops.cpu_prepack_moe_weight(w1, self.isa), ops.cpu_prepack_moe_weight(w2, self.isa)
            self.packed_versions = (w1._version, w2._version)
        return apply(self, w1=self.packed[0], w2=self.packed[1], **kwargs)

    CPUUnquantizedExperts.process_weights_after_loading = keep_parameters
    CPUUnquantizedExperts.apply = apply_packed
    CPUUnquantizedExperts.packs_from_parameters = True


def name_cpu_shm_by_world() -> None:
    """A sharded CPU engine all-reduces through /dev/shm segments that vLLM names by the shards' ranks only
    ('-tp:0-[0-1]-cpushm_0', ...): two runs on one machine (or two test processes) would both create the same and
    the second fails with 'create shm in SHMManager failed. errno: 17'. Prefixed with the process id of the world's
    rank 0, which rank 0 sends to every rank (a collective: every rank starts its engine together)."""
    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    world = [f"rlm{os.getpid()}"]
    dist.broadcast_object_list(world, src=0)
    vllms_name = getattr(_CPUSHMDistributed, "vllms_name", _CPUSHMDistributed.make_group_name)
    _CPUSHMDistributed.vllms_name = vllms_name
    # vLLM's name starts with the slashes of its init method's "env://" (shm_open strips leading slashes only).
    _CPUSHMDistributed.make_group_name = staticmethod(
        lambda communicator: world[0] + vllms_name(communicator).lstrip("/"))


def remove_stale_cpu_shm() -> None:
    """A sharded CPU engine's /dev/shm segments (`name_cpu_shm_by_world`) are left behind by a run that was killed.
    Remove those that no live process maps."""
    leftovers = set(glob.glob("/dev/shm/*-cpushm_*"))
    if not leftovers:
        return
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                leftovers -= {line.split(maxsplit=5)[-1].strip() for line in f if "cpushm_" in line}
        except OSError:  # the process ended, or is not ours to read
            continue
    for path in leftovers:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
