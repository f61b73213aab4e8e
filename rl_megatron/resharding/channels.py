"""How a bucket travels between two ranks of the same process group. One interface, two channels:

- `ProcessGroupChannel`: torch.distributed point-to-point — gloo between CPU processes, NCCL between GPUs
  (colocated ranks, or the broadcast group of a disaggregated engine).
- `SharedMemoryChannel` (CPU only): the sender packs straight into a buffer the receiver has mapped (POSIX shared
  memory, mapped once when the plan is made); only one-element ready/done signals go through the process group.
  One copy on each side.

Pieces whose source and target are on the same rank never use a channel: they are copied in place.

Every rank walks the plan's rounds in order. In a round it sends at most one bucket and receives at most one, and
it posts both together (`start_round`) before it waits for either (`received`, `end_round`). Over NCCL that must
be one batched call (`torch.distributed.batch_isend_irecv`, as Megatron's pipeline exchange does): NCCL runs the
point-to-point calls between two ranks in order on one stream and ignores tags, so a send to B posted alone and a
receive from B posted after it wait on B's send and receive posted the same way, and a round where A sends to B
while B sends to A never ends. (gloo's isend really is asynchronous, so a CPU run cannot show it;
`tests/distributed/test_p2p_schedule.py` replays what each rank posts under NCCL's rules.) A batched call also runs
on the group's own communicator: no two-rank communicator is created per pair of ranks, as separate sends would.
"""
from __future__ import annotations

import os
import uuid

import torch
import torch.distributed as dist

from rl_megatron.config.choices import CHANNELS


class Channel:
    def connect(self, sends_to: set[int], receives_from: set[int]) -> None:
        """Called once on every rank (a collective) with the peers of this rank in the plan."""

    def buffer_for(self, dst: int, nbytes: int) -> torch.Tensor:
        """uint8 tensor of `nbytes` the sender packs the next bucket for `dst` into."""
        raise NotImplementedError

    def start_round(self, send_to: int | None, receive: tuple[int, int] | None) -> None:
        """Post this round's send (of the packed bucket, to `send_to`) and receive (`(src, nbytes)`) together."""
        raise NotImplementedError

    def received(self) -> torch.Tensor:
        """The round's incoming bucket, once it has arrived; valid until `release(src)`."""
        raise NotImplementedError

    def release(self, src: int) -> None:
        pass

    def end_round(self) -> None:
        """After a round: this rank's outgoing bucket may still be in flight only if the channel keeps it."""

    def finish(self) -> None:
        """Wait for outstanding signals; after this no buffer is in use."""

    def close(self) -> None:
        """Free the buffers kept between syncs."""

    # Plan buckets a rank may hold at once: the plan's buckets are `bucket_bytes / slots`, so that the channel
    # never holds more than `bucket_bytes`.
    slots = 1

    @property
    def owned_bytes(self) -> int:
        """Buffer memory this channel keeps between syncs."""
        return 0


class ProcessGroupChannel(Channel):
    """A round's outgoing and incoming buckets travel in one batched call: two buckets at most."""

    slots = 2

    def __init__(self, device: torch.device):
        self.device = device
        self.outgoing: torch.Tensor | None = None
        self.incoming: torch.Tensor | None = None
        self.pending: list = []

    def buffer_for(self, dst, nbytes):
        self.outgoing = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.outgoing

    def start_round(self, send_to, receive):
        ops = []
        if send_to is not None:
            ops.append(dist.P2POp(dist.isend, self.outgoing, send_to))
        if receive is not None:
            src, nbytes = receive
            self.incoming = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            ops.append(dist.P2POp(dist.irecv, self.incoming, src))
        self.pending = dist.batch_isend_irecv(ops) if ops else []

    def _wait(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending = []

    def received(self):
        self._wait()
        return self.incoming

    def release(self, src):
        self.incoming = None

    def end_round(self):
        self._wait()
        self.outgoing = None


DONE = 1  # tag of 'buffer free again' signals, which overtake the data messages between the same two ranks


class SharedMemoryChannel(Channel):
    """Each rank owns one shared send buffer of `capacity` bytes in two slots: it packs the next bucket into one
    slot while a receiver still reads the other (a slot is reused once its receiver has said 'done'). CPU only: its
    'done' signals overtake data messages by their tag, which NCCL ignores."""

    slots = 2

    def __init__(self, device: torch.device, capacity: int):
        self.device, self.slot_bytes = device, capacity // self.slots
        self.receiving: int | None = None  # the peer whose bucket this round brings
        self.outbox: torch.Tensor | None = None
        self.inboxes: dict[int, torch.Tensor] = {}  # peers' buffers mapped here
        self.readers: list[int | None] = [None] * self.slots  # the peer reading each of our slots now
        self.next_slot = 0
        self.pending: list = []

    def _signal(self, value: int = 0) -> torch.Tensor:
        return torch.full((1,), value, dtype=torch.int64, device=self.device)

    def _wait_done(self, slot: int) -> None:
        if self.readers[slot] is not None:
            dist.recv(self._signal(), self.readers[slot], tag=DONE)
            self.readers[slot] = None

    def connect(self, sends_to, receives_from):
        handle = None
        if sends_to:
            self.outbox = SharedBuffer.create(self.slots * self.slot_bytes)
            handle = self.outbox.handle
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, handle)
        self.inboxes = {src: SharedBuffer.attach(everyone[src]) for src in receives_from}
        dist.barrier()
        if self.outbox is not None:
            self.outbox.unlink()

    def buffer_for(self, dst, nbytes):
        slot = self.next_slot
        self._wait_done(slot)
        return self.outbox.tensor[slot * self.slot_bytes:][:nbytes]

    def start_round(self, send_to, receive):
        if send_to is not None:
            slot = self.next_slot
            self.pending.append(dist.isend(self._signal(slot), send_to))
            self.readers[slot] = send_to
            self.next_slot = (slot + 1) % self.slots
        self.receiving = receive

    def received(self):
        src, nbytes = self.receiving
        slot = self._signal()
        dist.recv(slot, src)
        return self.inboxes[src].tensor[int(slot) * self.slot_bytes:][:nbytes]

    def release(self, src):
        self.pending.append(dist.isend(self._signal(), src, tag=DONE))

    def finish(self):
        for slot in range(self.slots):
            self._wait_done(slot)
        for work in self.pending:
            work.wait()
        self.pending = []

    @property
    def owned_bytes(self) -> int:
        return 0 if self.outbox is None else self.outbox.tensor.numel()

    def close(self):
        self.inboxes, self.outbox = {}, None  # unmapped when the last view goes


def shared_file_prefix() -> str:
    """The /dev/shm names of this process's PID namespace (its inode): a process id means something only there, and
    containers may share /dev/shm across namespaces. (`shared_params` sweeps the files of dead processes by it.)"""
    return f"/dev/shm/rl_megatron-{os.stat('/proc/self/ns/pid').st_ino}-"


class SharedBuffer:
    """A uint8 buffer other processes on this machine can map: a file in /dev/shm (handle: its path and size)."""

    def __init__(self, tensor: torch.Tensor, handle, path: str | None = None):
        self.tensor, self.handle, self.path = tensor, handle, path

    @classmethod
    def create(cls, nbytes: int) -> "SharedBuffer":
        path = f"{shared_file_prefix()}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        return cls(torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), (path, nbytes), path)

    @classmethod
    def attach(cls, handle) -> "SharedBuffer":
        path, nbytes = handle
        return cls(torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), handle)

    def unlink(self) -> None:
        """Remove the name once every peer has mapped the buffer: the memory lives until the last mapping goes,
        and a killed run leaves nothing behind."""
        if self.path is not None:
            os.unlink(self.path)
            self.path = None


def make_channel(name: str, device: torch.device, bucket_bytes: int) -> Channel:
    if name == "process_group":
        return ProcessGroupChannel(device)
    if name == "shared_memory":
        if device.type != "cpu":
            raise ValueError(f"resharding.channel=shared_memory works between CPU processes only (its signals rely "
                             f"on message tags, which NCCL ignores), not on {device.type}: use resharding.channel=auto "
                             "or process_group.")
        return SharedMemoryChannel(device, bucket_bytes)
    raise ValueError(f"resharding.channel={name!r}: choose one of {', '.join(CHANNELS)}")
