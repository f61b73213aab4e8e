"""Ray's debugger through the project's own Ray and worker groups: Ray started as the trainer starts it, with
RAY_DEBUG=legacy in the environment, and a WorkerGroup given the trainer's `worker_env`. RAY_DEBUG reaches every
worker, and a worker's breakpoint() pauses its method until a debugger lets it go on: as `ray debug` does
(RAY_DEBUG=legacy: the breakpoint registered in Ray's internal KV, a pdb on a socket), and as VS Code's Ray
Distributed Debugger does (RAY_DEBUG=1: the paused thread and debugpy's port in Ray's worker table, which the
dashboard lists to the extension, then the Debug Adapter Protocol)."""
import contextlib
import io
import json
import logging
import socket
import time

import pytest

from helpers.ray_debug import assert_ray_debug_reached_workers
from helpers.ray_workers import set_up_only_worker

PAUSED_S = 2.0  # a paused method must not have returned within this
ATTACH_TIMEOUT_S = 15.0  # for the breakpoint to be registered, and for each exchange with a debugger


def paused_worker_class() -> type:
    """A worker for WorkerGroup whose `pause_then_return` stops at breakpoint(). Made in a function so that Ray
    ships the class by value: the workers cannot import this test module."""

    class Paused(set_up_only_worker()):
        def pause_then_return(self, value):
            breakpoint()
            return value

    return Paused


@pytest.fixture(scope="module")
def project_ray(ray_session):
    """The test run's Ray (`ray_session`, started by `start_ray` as the trainer starts it), with RAY_DEBUG=legacy in the
    controller's environment for this module; what `start_ray` printed when called now, as the trainer calls it."""
    from rl_megatron.preflight import load_config
    from rl_megatron.workers.cluster import start_ray

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_DEBUG", "legacy")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            start_ray(load_config("configs/demo_cpu.yaml", ["ray.num_cpus=2"]))
        yield printed.getvalue()


@contextlib.contextmanager
def debugged_group(caplog):
    """Two workers placed as the trainer places them, with the trainer's worker environment (built now)."""
    from rl_megatron.trainer.workers import worker_env
    from rl_megatron.workers.worker_group import ResourcePool, WorkerGroup

    caplog.set_level(logging.INFO, logger="rl_megatron.workers.worker_group")
    with WorkerGroup(paused_worker_class(), ResourcePool(1, 2), env=worker_env(1, local_cluster=True),
                     name="debugged") as group:
        yield group


def until(found, what: str):
    """`found()`'s first true value, polled until ATTACH_TIMEOUT_S."""
    deadline = time.monotonic() + ATTACH_TIMEOUT_S
    while not (value := found()):
        assert time.monotonic() < deadline, f"{what} within {ATTACH_TIMEOUT_S:g} s"
        time.sleep(0.1)
    return value


def legacy_breakpoint() -> dict:
    """The one active breakpoint, read as `ray debug` reads them (Ray's internal KV)."""
    from ray._private.ray_constants import KV_NAMESPACE_PDB
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    [key] = until(lambda: _internal_kv_list("RAY_PDB_", namespace=KV_NAMESPACE_PDB),
                  "Ray's legacy debugger registered no breakpoint")
    return json.loads(_internal_kv_get(key, namespace=KV_NAMESPACE_PDB))


def paused_worker_debugpy_port(pid: int) -> int:
    """debugpy's port in the worker `pid`, once Ray's worker table counts a thread of it paused for a debugger."""
    import ray
    from ray.core.generated.gcs_pb2 import WorkerTableData

    accessor = ray._private.state.state._connect_and_get_accessor()

    def paused():
        rows = [WorkerTableData.FromString(row) for row in accessor.get_worker_table()]
        [worker] = [row for row in rows if row.pid == pid and row.is_alive]
        return worker.debugger_port if worker.num_paused_threads == 1 else None

    return until(paused, "Ray's worker table shows no thread of the worker paused")


class DebugAdapterClient:
    """A minimal client of the Debug Adapter Protocol (what VS Code speaks to debugpy): requests, and the messages
    that come back, kept until asked for."""

    def __init__(self, host: str, port: int):
        self.connection = socket.create_connection((host, port), timeout=ATTACH_TIMEOUT_S)
        self.unread, self.received, self.last_seq = b"", [], 0

    def send(self, command: str, **arguments) -> int:
        self.last_seq += 1
        body = json.dumps({"seq": self.last_seq, "type": "request", "command": command, "arguments": arguments})
        self.connection.sendall(f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        return self.last_seq

    def request(self, command: str, **arguments) -> dict:
        seq = self.send(command, **arguments)
        response = self.wait_for(lambda message: message.get("request_seq") == seq)
        assert response["success"], response
        return response.get("body", {})

    def event(self, name: str) -> dict:
        return self.wait_for(lambda message: message.get("event") == name).get("body", {})

    def wait_for(self, wanted) -> dict:
        while not any(wanted(message) for message in self.received):
            self.received.append(self._read())
        message = next(message for message in self.received if wanted(message))
        self.received.remove(message)
        return message

    def _read(self) -> dict:
        while b"\r\n\r\n" not in self.unread:
            self.unread += self._receive()
        header, self.unread = self.unread.split(b"\r\n\r\n", 1)
        length = int(header.split(b":")[1])
        while len(self.unread) < length:
            self.unread += self._receive()
        body, self.unread = self.unread[:length], self.unread[length:]
        return json.loads(body)

    def _receive(self) -> bytes:
        chunk = self.connection.recv(65536)
        assert chunk, "debugpy closed the connection"
        return chunk

    def close(self) -> None:
        self.connection.close()


def test_with_legacy_a_breakpoint_pauses_the_worker_until_ray_debug_continues_it(project_ray, caplog):
    import ray

    assert "Ray debugger on (RAY_DEBUG=legacy)" in project_ray and "`ray debug --address " in project_ray
    with debugged_group(caplog) as group:
        assert_ray_debug_reached_workers(caplog.records, "legacy")
        call = group.workers[0].pause_then_return.remote(7)
        assert not ray.wait([call], timeout=PAUSED_S)[0], "the method returned: breakpoint() did not pause it"
        session = legacy_breakpoint()
        assert session["proctitle"] == "ray::Paused.pause_then_return" and session["filename"] == __file__
        host, port = session["pdb_address"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=ATTACH_TIMEOUT_S) as pdb:
            shown = b""
            while not shown.endswith(b"(Pdb) "):
                shown += pdb.recv(4096)
            assert b"-> return value" in shown  # stopped in the method, on the line after breakpoint()
            pdb.sendall(b"c\n")
        assert ray.get(call, timeout=ATTACH_TIMEOUT_S) == 7


def test_with_ray_debug_1_a_breakpoint_waits_for_vs_code_and_continues_from_it(project_ray, caplog, monkeypatch):
    import ray

    monkeypatch.setenv("RAY_DEBUG", "1")  # for the workers' environment: this Ray was started with legacy
    with debugged_group(caplog) as group:
        assert_ray_debug_reached_workers(caplog.records, "1")
        call = group.workers[0].pause_then_return.remote(7)
        assert not ray.wait([call], timeout=PAUSED_S)[0], "the method returned: breakpoint() did not pause it"
        where = group.placement[0]
        debugger = DebugAdapterClient(where.node_ip, paused_worker_debugpy_port(where.pid))
        try:
            debugger.request("initialize", adapterID="debugpy", clientID="rl_megatron-test", pathFormat="path")
            attaching = debugger.send("attach", justMyCode=False)
            debugger.event("initialized")
            debugger.request("configurationDone")
            debugger.wait_for(lambda message: message.get("request_seq") == attaching)
            thread = debugger.event("stopped")["threadId"]
            [frame, *_] = debugger.request("stackTrace", threadId=thread)["stackFrames"]
            assert frame["name"] == "pause_then_return" and frame["source"]["path"] == __file__
            debugger.request("continue", threadId=thread)
        finally:
            debugger.close()
        assert ray.get(call, timeout=ATTACH_TIMEOUT_S) == 7
