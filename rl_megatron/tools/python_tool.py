"""A Python tool: runs the model's code in a sandboxed subprocess and returns what it printed.

Code the model writes is hostile. The layers, each independent of the others:
  - a kernel boundary (`rl_megatron/tools/sandbox.py`, `isolation: namespaces`, the default): fresh user, PID, mount,
    network, IPC and UTS namespaces, the code's interpreter as PID 1 of its own PID namespace (everything it starts
    dies with it; nothing outside is visible or signalable), a private root (a size-limited tmpfs with /work, /tmp
    and /dev/shm, gone with the call; read-only /usr and the interpreter's standard library; no /etc, home, project
    or checkpoints; no Unix sockets of the host), no network but loopback, no capabilities, no new privileges, and
    a parent-death signal: a trainer that dies takes its sandboxes with it. Where the machine cannot set it up, the
    tool refuses to start (pre-flight names the key); `isolation: none` runs without it, and is unsafe: the code
    can then read and write what the trainer's user can;
  - a fresh interpreter per call, stdlib only (`-I -S`: no site-packages, no .pth files, no PYTHON* variables), with
    a minimal environment (PATH, LANG, HOME, TMPDIR: nothing inherited that could hold a secret). The code comes in
    over stdin, read to its end before it runs: no file holds it, so no other call can rewrite it before it is read;
  - resource limits set by the launcher before the code runs: CPU time (RLIMIT_CPU), address space (RLIMIT_AS),
    size of a written file (RLIMIT_FSIZE), open files (RLIMIT_NOFILE), processes (RLIMIT_NPROC, counted in the
    call's own user namespace), no core files; and where this process can make cgroups, a pids and memory cgroup
    for the whole call (cgroups.py: it also bounds a trainer running as root, which RLIMIT_NPROC exempts);
  - a wall-clock limit: on timeout (or cancellation) the whole process group (start_new_session) is killed, and it
    is killed after every call too;
  - an audit hook (sys.addaudithook) installed before the code runs that raises PermissionError on network use,
    process creation, signals, raising the limits, native calls through ctypes, and changes to the hook itself. It
    gives well-meaning code a clear message; it is not the boundary (code can get around an audit hook).

The tool's `config` (all optional): timeout_s, cpu_time_s, memory_mb, file_size_mb, disk_mb, max_open_files,
max_processes, max_output_bytes, isolation, rate_limit (calls at once in the process running the agent loops: by
default one per CPU core; the rest wait for a slot, outside their time limit, counted in tool/slot_wait_s); see
PythonLimits. Each of stdout and stderr keeps its first max_output_bytes (read incrementally: a flood costs no
memory); stderr follows stdout in the text.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from rl_megatron.tools import sandbox
from rl_megatron.tools.cgroups import CallCgroup
from rl_megatron.tools.base import Tool, ToolOutcome

logger = logging.getLogger(__name__)

# Runs in the child: limits, then the hook, then the code (compiled as "<code>"; its lines show in a traceback).
_LAUNCHER = r'''
import os, resource, signal, sys, _posixsubprocess
cpu_s, memory_bytes, file_bytes, open_files, processes = map(int, sys.argv[1:6])
os.chdir(os.environ["HOME"])  # the working folder (isolated: /work in the call's own root)
# The CPU limit's signal as an exit status: `unshare --fork` does not pass SIGXCPU on (it reports its own error).
signal.signal(signal.SIGXCPU, lambda *_: os._exit(128 + signal.SIGXCPU))
source = sys.stdin.buffer.read().decode("utf-8")  # to its end: the code then reads an empty stdin

def limit(which, soft, hard):
    ceiling = resource.getrlimit(which)[1]  # a limit can only be lowered: stay under the one inherited
    if ceiling != resource.RLIM_INFINITY:
        soft, hard = min(soft, ceiling), min(hard, ceiling)
    resource.setrlimit(which, (soft, hard))

limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)  # SIGXCPU at the soft limit, SIGKILL a second later
limit(resource.RLIMIT_AS, memory_bytes, memory_bytes)
limit(resource.RLIMIT_FSIZE, file_bytes, file_bytes)
limit(resource.RLIMIT_CORE, 0, 0)
limit(resource.RLIMIT_NOFILE, open_files, open_files)
limit(resource.RLIMIT_NPROC, processes, processes)  # in the call's user namespace (the cgroup also bounds root)
code = compile(source, "<code>", "exec")

def _blocked_fork_exec(*args, **kwargs):
    raise PermissionError("creating processes is blocked in this sandbox")

_posixsubprocess.fork_exec = _blocked_fork_exec  # subprocess's way around the os.fork audit event

def _audit(event, args, _self=None, _error=None, _network=None, _blocked=None):
    if event in _network:
        raise _error(f"network access is blocked in this sandbox ({event})")
    if (event in _blocked or (event == "ctypes.dlopen" and args[0] is not None)
            or (event == "import" and args[0] == "_posixsubprocess")
            or (event == "object.__setattr__" and args[0] is _self)):
        raise _error(f"{event} is blocked in this sandbox (no processes, signals, limit changes or native calls)")

# Bound as defaults (an immutable tuple; replacing it or the code is blocked above), so that the code cannot
# change what the hook sees by rebinding names in this module.
_audit.__defaults__ = (_audit, PermissionError, frozenset({
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo", "socket.gethostbyname",
    "socket.gethostbyaddr", "socket.getnameinfo"}), frozenset({
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
    "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit", "ctypes.call_function",
    "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata", "ctypes.cdata/buffer"}))
sys.addaudithook(_audit)
try:
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as error:
    import linecache, traceback  # only now: their imports are a third of a trivial call's start-up
    linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")  # the code's lines, shown
    report = traceback.TracebackException.from_exception(error)
    # the launcher's frames (its exec, the hook) are "<string>": the model sees its own code's frames only
    report.stack = traceback.StackSummary.from_list([frame for frame in report.stack if frame.filename != "<string>"])
    print("".join(report.format()), end="", file=sys.stderr)
    sys.exit(1)
'''


ISOLATIONS = ("namespaces", "none")


@dataclass(frozen=True)
class PythonLimits:
    """The tool's `config` keys."""
    timeout_s: float = 10.0  # wall clock per call
    cpu_time_s: float = 5.0  # RLIMIT_CPU, in whole seconds (rounded up)
    memory_mb: int = 512  # RLIMIT_AS: the address space, so a little above what the code may allocate
    file_size_mb: int = 64  # RLIMIT_FSIZE: the largest file the code may write
    disk_mb: int = 64  # the call's private tmpfs (/work, /tmp and /dev/shm together; counts towards RAM)
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_processes: int = 16  # RLIMIT_NPROC, and the call's pids cgroup where there is one (cgroups.py)
    max_output_bytes: int = 65536  # kept of stdout, and of stderr
    isolation: str = "namespaces"  # the kernel boundary (sandbox.py); none: no boundary (unsafe)
    rate_limit: int = field(default_factory=os.cpu_count)  # calls at once (verl's key); the rest wait for a slot

    @classmethod
    def from_config(cls, config: dict) -> PythonLimits:
        unknown = sorted(set(config) - {field.name for field in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)}; the keys are "
                             f"{', '.join(field.name for field in dataclasses.fields(cls))}")
        for name, value in config.items():
            if name == "isolation":
                if value not in ISOLATIONS:
                    raise ValueError(f"isolation={value!r} must be one of {', '.join(ISOLATIONS)}")
            elif isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive number")
        return cls(**config)


class PythonTool(Tool):
    def __init__(self, config: dict, schema: dict):
        super().__init__(config, schema)
        self.limits = PythonLimits.from_config(config)
        self.rate_limit = int(self.limits.rate_limit)
        self.isolated = self.limits.isolation == "namespaces"
        if self.isolated and not sandbox.available():
            raise ValueError("isolation: namespaces (the default) cannot be set up here: `unshare --user "
                             "--map-root-user --pid --mount --net` fails (unprivileged user namespaces are off, e.g. "
                             "under Docker's default seccomp profile: run the container with --security-opt "
                             "seccomp=unconfined, or enable kernel.unprivileged_userns_clone). To run model code "
                             "without a kernel boundary, set isolation: none in this tool's config (unsafe)")
        if not self.isolated:
            logger.warning("%s: isolation: none: the model's code runs without a kernel boundary and can read and "
                           "write what this user can", self.name)

    async def execute(self, arguments: dict, state: dict) -> ToolOutcome:
        if self.isolated:  # its folders are made inside its own namespaces: nothing on this machine to clean up
            return await self._run(arguments["code"], "/work", "/tmp")
        with tempfile.TemporaryDirectory(prefix="rl-megatron-python-", ignore_cleanup_errors=True) as folder:
            return await self._run(arguments["code"], folder, folder)

    async def _run(self, code: str, home: str, tmp: str) -> ToolOutcome:
        limits = self.limits
        interpreter = os.path.realpath(sys._base_executable) if self.isolated else sys.executable
        command = [interpreter, "-I", "-S", "-u", "-X", "utf8", "-c", _LAUNCHER, str(math.ceil(limits.cpu_time_s)),
                   str(int(limits.memory_mb * 2**20)), str(int(limits.file_size_mb * 2**20)),
                   str(int(limits.max_open_files)), str(int(limits.max_processes))]
        if self.isolated:
            command = sandbox.isolated(command, int(limits.disk_mb))
        environment = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": tmp}
        # Every process of the call together, where a cgroup can be made: its processes (the launcher's and the
        # sandbox's setup's among them) and its memory (the private tmpfs's pages included).
        cgroup = CallCgroup.create(int(limits.max_processes) + 4, int((limits.memory_mb + limits.disk_mb) * 2**20))
        try:
            return await self._supervise(command, code, "/" if self.isolated else home, environment, cgroup)
        finally:
            if cgroup is not None:
                cgroup.remove()

    async def _supervise(self, command: list[str], code: str, cwd: str, environment: dict,
                         cgroup: CallCgroup | None) -> ToolOutcome:
        """Run `command` with `code` on its stdin to its end or its time limit, and what it printed."""
        limits = self.limits

        def before_exec() -> None:  # in the child: dies with the trainer, counted in the call's cgroup
            sandbox.die_with_parent()
            if cgroup is not None:
                cgroup.join()

        process = await asyncio.create_subprocess_exec(
            *command, cwd=cwd, env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=before_exec)
        process.stdin.write(code.encode("utf-8"))
        process.stdin.close()  # the launcher reads to this end before the code runs
        stdout, stderr = _Capture(limits.max_output_bytes), _Capture(limits.max_output_bytes)
        tasks = [asyncio.create_task(stdout.read(process.stdout)), asyncio.create_task(stderr.read(process.stderr)),
                 asyncio.create_task(process.wait())]
        try:
            _, running = await asyncio.wait(tasks, timeout=limits.timeout_s)
        finally:  # also on cancellation (ToolSet.call's own timeout)
            _kill_group(process.pid)
            await asyncio.wait(tasks, timeout=1.0)  # the output already in the pipes
            for task in tasks:
                task.cancel()
            await process.wait()
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return _outcome(stdout, stderr, process.returncode, bool(running), limits)


class _Capture:
    """The first `limit` bytes of a stream, and a count of the rest (read and dropped)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0

    async def read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            keep = max(0, self.limit - len(self.data))
            self.data += chunk[:keep]
            self.dropped += max(0, len(chunk) - keep)

    def text(self, name: str) -> str:
        text = self.data.decode("utf-8", errors="replace")
        return _with_note(text, f"[... {self.dropped} more bytes of {name} dropped]\n") if self.dropped else text


def _outcome(stdout: _Capture, stderr: _Capture, returncode: int, timed_out: bool,
             limits: PythonLimits) -> ToolOutcome:
    text = _with_note(stdout.text("stdout"), stderr.text("stderr")) if stderr.data else stdout.text("stdout")
    if timed_out or returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        limit = f"{limits.timeout_s:g} s of wall time" if timed_out else f"{math.ceil(limits.cpu_time_s)} s of CPU time"
        note = f"Error: the code ran past its limit of {limit} and was killed."
        return ToolOutcome.failure(_with_note(text, note), timed_out=True)
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
        return ToolOutcome.failure(_with_note(text, f"Error: the process was killed by {name} (out of memory or "
                                                    "CPU time?)."))
    if returncode > 0:
        return ToolOutcome.failure(text if stderr.data else _with_note(text, f"Error: exit code {returncode}."))
    return ToolOutcome(text=text or "(no output)")


def _with_note(text: str, note: str) -> str:
    """`note` on a line of its own after `text`."""
    return text + note if not text or text.endswith("\n") else f"{text}\n{note}"


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # gone already (its id perhaps reused by another user's group)
        pass
