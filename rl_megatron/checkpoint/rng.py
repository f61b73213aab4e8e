"""A worker's random number generators (Python, NumPy, torch CPU and CUDA, Megatron's tensor-parallel tracker),
saved with each checkpoint and restored when the run resumes in the same layout. Under another layout the ranks
are different processes with different streams, so the states are not restored (the caller says so).

The file holds tensors, numbers, strings and dicts only, and is read with `torch.load(weights_only=True)`: a
checkpoint from elsewhere cannot run code through it. Files of the earlier pickled format are not read (their
states start afresh); sampling seeds depend on trainer.seed and the step alone, so rollouts are unaffected.
"""
from __future__ import annotations

import pickle
import random

import numpy as np
import torch

FORMAT_VERSION = 2  # 1: the pickled Python/NumPy objects, which weights_only=True refuses


def rng_state(layout: dict) -> dict:
    from megatron.core import tensor_parallel

    version, python_state, gauss_next = random.getstate()
    key, numpy_state, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {"format_version": FORMAT_VERSION, "layout": layout,
            "python": {"version": version, "state": torch.tensor(python_state, dtype=torch.int64),
                       "gauss_next": gauss_next},
            "numpy": {"key": key, "state": torch.from_numpy(numpy_state.astype(np.int64)), "pos": pos,
                      "has_gauss": has_gauss, "cached_gaussian": cached_gaussian},
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "megatron_tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def save_rng_state(path: str, layout: dict) -> None:
    torch.save(rng_state(layout), path)


def restore_rng_state(path: str, layout: dict) -> bool:
    """Restore the states saved at `path` if they were saved in `layout`; False (nothing restored) otherwise, or
    when the file is of the old pickled format."""
    from megatron.core import tensor_parallel

    try:
        state = torch.load(path, weights_only=True)
    except FileNotFoundError:
        return False
    except pickle.UnpicklingError:  # format 1: it could run code when unpickled, so it is not read
        return False
    if state.get("format_version") != FORMAT_VERSION or state["layout"] != layout:
        return False
    python, numpy = state["python"], state["numpy"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss_next"]))
    np.random.set_state((numpy["key"], numpy["state"].numpy().astype(np.uint32), numpy["pos"], numpy["has_gauss"],
                         numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
    return True
