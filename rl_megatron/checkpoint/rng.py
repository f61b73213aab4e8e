"""A worker's random number generators (Python, NumPy, torch CPU and CUDA, Megatron's tensor-parallel tracker),
saved with each checkpoint and restored when the run resumes in the same layout. Under another layout the ranks
are different processes with different streams, so the states are not restored (the caller says so)."""
from __future__ import annotations

import random

import numpy as np
import torch


def rng_state(layout: dict) -> dict:
    from megatron.core import tensor_parallel

    return {"layout": layout, "python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "megatron_tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def save_rng_state(path: str, layout: dict) -> None:
    torch.save(rng_state(layout), path)


def restore_rng_state(path: str, layout: dict) -> bool:
    """Restore the states saved at `path` if they were saved in `layout`; False (nothing restored) otherwise."""
    from megatron.core import tensor_parallel

    try:
        state = torch.load(path, weights_only=False)
    except FileNotFoundError:
        return False
    if state["layout"] != layout:
        return False
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
    return True
