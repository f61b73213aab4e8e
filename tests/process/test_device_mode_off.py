"""The CUDA-to-CPU mode is switched off around the vLLM engine's steps (platform/cpu_compat.device_mode_off) and on
again after, and left alone where another mode was entered after it. In a fresh interpreter: the mode is global to
the thread that applies it."""
import subprocess
import sys

SCRIPT = """
import torch
from torch.overrides import TorchFunctionMode
from rl_megatron import platform
from rl_megatron.platform import cpu_compat

platform.setup()
stack = torch._C._len_torch_function_stack
assert stack() == 1 and torch._C._get_function_stack_at(0) is cpu_compat._device_mode
with cpu_compat.device_mode_off():
    assert stack() == 0
    assert torch.zeros(1, device="cpu").device.type == "cpu"
assert stack() == 1 and torch._C._get_function_stack_at(0) is cpu_compat._device_mode
with TorchFunctionMode():  # another mode on top: the device mode cannot be taken out from under it
    with cpu_compat.device_mode_off():
        assert stack() == 2
print("ok")
"""


def test_the_device_mode_is_off_inside_and_on_after():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
