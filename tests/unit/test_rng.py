"""RNG states in checkpoints: restored exactly in the same layout, and read without unpickling, so a checkpoint from
elsewhere cannot run code through its rng files."""
import os
import random

import numpy as np
import torch

from rl_megatron.checkpoint.rng import restore_rng_state, save_rng_state

LAYOUT = {"tp": 2, "pp": 1, "rank": 0, "world_size": 2}


def draws():
    return random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(3).tolist()


def test_states_come_back_exactly_and_only_in_their_layout(tmp_path):
    path = str(tmp_path / "rng.pt")
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.randn()  # cached Gaussians are part of the state
    save_rng_state(path, LAYOUT)
    expected = draws()
    assert restore_rng_state(path, LAYOUT) and draws() == expected
    assert not restore_rng_state(path, dict(LAYOUT, tp=1))
    assert not restore_rng_state(str(tmp_path / "missing.pt"), LAYOUT)
    torch.load(path, weights_only=True)  # nothing in it needs unpickling


class RunsCode:
    """What a hostile pickle can do on load: call any function, here one that leaves a file behind."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_pickled_rng_file_is_not_unpickled(tmp_path):
    path, marker = str(tmp_path / "rng.pt"), str(tmp_path / "code_ran")
    torch.save({"layout": LAYOUT, "python": RunsCode(marker)}, path)
    assert not restore_rng_state(path, LAYOUT)
    assert not os.path.exists(marker)
    # The earlier format (pickled NumPy arrays and Python tuples) is refused the same way: its states start afresh.
    torch.save({"layout": LAYOUT, "numpy": np.random.get_state()}, path)
    assert not restore_rng_state(path, LAYOUT)
