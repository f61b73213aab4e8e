"""The bench's host-sync counter (rl_megatron/bench/host_syncs.py): it counts the operations that would make a GPU
run's host wait, on tensors a GPU run holds on the GPU, and nothing on host tensors."""
import torch

from rl_megatron.bench.host_syncs import HostSyncCounter, module_tensors

DEVICE = torch.device("cpu")  # the compute device of a CPU run


def counted(fn, device_tensors=()):
    with HostSyncCounter(device_tensors, DEVICE) as counter:
        fn()
    return counter


def test_reading_a_device_value_counts_and_reading_a_host_value_does_not():
    layer = torch.nn.Linear(4, 4)
    host = torch.ones(4)

    def step():
        out = layer(host.to(DEVICE, non_blocking=True))  # the output of device weights is on the device
        out.sum().item()  # 1
        out.tolist()  # 1
        if out.max() > 0:  # 1: bool of a device tensor
            pass
        host.sum().item()  # a host tensor: free
        out[out > 0]  # 1: the size depends on the data
        out.to("cpu").tolist()  # 1 for the copy down; the copy is a host tensor

    counter = counted(step, layer.parameters())
    assert counter.count == 5, counter.report()
    assert sum(n for (name, _), n in counter.sites.items() if name == "item") == 1


def test_blocking_copies_up_and_lists_of_device_values_count():
    weight = torch.ones(3)

    def step():
        torch.ones(3).to(DEVICE)  # 1: a blocking copy up (from pageable memory it waits)
        torch.ones(3).to(DEVICE, non_blocking=True)  # queued: free
        torch.tensor([1, 2], device=DEVICE)  # 1: built on the host, copied up waiting
        torch.tensor([weight[0], weight[1]])  # 2: each device value read through the host
        weight.masked_fill(weight > 0, 0.0)  # on the device: free
        scratch = weight * 2
        scratch[scratch > 1] = 0.0  # a mask assigned a number is masked_fill_: free

    assert counted(step, [weight]).count == 4


def test_optimizer_state_is_on_the_device_but_not_adams_step_count():
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    tensors = list(module_tensors([layer, optimizer]))
    state = optimizer.state[layer.weight]
    assert any(t is state["exp_avg"] for t in tensors)
    assert not any(t is state["step"] for t in tensors)  # a host tensor unless capturable or fused
    assert counted(optimizer.step, tensors).count == 0
