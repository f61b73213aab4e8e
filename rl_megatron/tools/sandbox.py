"""The kernel boundary around a sandboxed program: fresh user, PID, mount, network, IPC and UTS namespaces, a private
root filesystem, no capabilities.

`isolated(command, ...)` wraps a command (an interpreter and its arguments) so that it runs:
- in namespaces of its own (util-linux `unshare`, unprivileged: the user namespace gives the setup its rights), as
  PID 1 of its PID namespace, so every process it starts dies with it and no process outside is visible or can be
  signalled (pidfd_open finds nothing); `--kill-child` ends it when `unshare` ends, and the launcher gives `unshare`
  a parent-death signal, so a trainer that dies takes its sandboxes with it;
- in an empty network namespace (loopback only): no IP networking; and a private root filesystem, so no Unix socket
  of the host (Ray's, Docker's) exists there either;
- with a root of its own: a size-limited tmpfs holding `/work` (the working folder), `/tmp` and `/dev/shm`, gone with
  the namespace; read-only binds of `/usr` (and the interpreter's prefix, when outside it) and of /dev/null,
  /dev/zero, /dev/random, /dev/urandom; a /proc of its own PID namespace. No /etc, /home, /root, project,
  checkpoints or other processes' command lines;
- with no new privileges and no capabilities (`setpriv`): it cannot remount, unmount or change its limits' ceiling.

This is the pattern of bubblewrap and nsjail, built from util-linux alone so that it works wherever `unshare` does
(pip installs nothing for it). Where the kernel refuses unprivileged user namespaces (Docker's default seccomp
profile, some distributions), `available()` is False and the tools that need it refuse to start, saying so.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sys

PR_SET_PDEATHSIG = 1
_DEVICES = ("null", "zero", "random", "urandom")

# Runs as the user namespace's root, in the new mount and PID namespaces: builds the root, then hands over to the
# command without capabilities. $1: chroot; $2: the new root's mount point; $3: its size in MiB; $4..: read-only
# binds; after "--": the command.
_SETUP = r'''
set -e
chroot=$1; root=$2; size=$3; shift 3
mount -t tmpfs -o "size=${size}m,mode=755,nosuid,nodev" sandbox "$root"
mkdir -p "$root/work" "$root/tmp" "$root/dev/shm" "$root/proc"
chmod 1777 "$root/tmp" "$root/dev/shm"
while [ "$1" != "--" ]; do
  mkdir -p "$root$1"
  mount --bind "$1" "$root$1"
  mount -o remount,bind,ro,nosuid,nodev "$root$1"
  shift
done
shift
for link in bin lib lib64 sbin; do
  if [ -L "/$link" ]; then ln -s "$(readlink "/$link")" "$root/$link"; fi
done
for device in null zero random urandom; do
  touch "$root/dev/$device"
  mount --bind "/dev/$device" "$root/dev/$device"
done
mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
unset PWD OLDPWD  # the shell's own: the command gets the environment it was given
exec "$chroot" "$root" /usr/bin/setpriv --no-new-privs --bounding-set=-all --inh-caps=-all "$@"
'''


@functools.cache
def _tools() -> tuple[str, ...] | None:
    """(unshare, sh, chroot) where they exist and /usr/bin holds setpriv (the new root's view of it)."""
    found = tuple(shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin") for name in ("unshare", "sh", "chroot"))
    if None in found or not os.access("/usr/bin/setpriv", os.X_OK):
        return None
    return found


def read_only_binds() -> list[str]:
    """What the new root shows of the host, read-only: /usr, and the interpreter's prefix when it lies elsewhere (a
    pyenv or conda interpreter)."""
    binds = ["/usr"]
    prefix = os.path.realpath(sys.base_prefix)
    if not (prefix + "/").startswith("/usr/"):
        binds.append(prefix)
    return binds


def isolated(command: list[str], root: str, size_mb: int) -> list[str]:
    """`command` run inside the boundary, from / (it changes to /work itself); `root`: an empty folder the new root is
    mounted on (outside the namespace it stays empty); `size_mb`: the tmpfs's size (/work, /tmp and /dev/shm)."""
    unshare, sh, chroot = _tools()
    return [unshare, "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--mount", "--net", "--ipc",
            "--uts", sh, "-c", _SETUP, "sandbox-setup", chroot, root, str(size_mb), *read_only_binds(), "--",
            *command]


def die_with_parent() -> None:
    """For a child between fork and exec (subprocess's preexec_fn): SIGKILL when the process that started it ends."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 9)


@functools.cache
def available() -> bool:
    """Whether the boundary can be set up here: one trivial program run through it (probed once per process)."""
    if _tools() is None:
        return False
    interpreter = os.path.realpath(sys._base_executable)
    root = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"rl-megatron-sandbox-probe-{os.getpid()}")
    os.makedirs(root, exist_ok=True)
    try:
        probe = subprocess.run(isolated([interpreter, "-I", "-S", "-c", "print('ok')"], root, 1),
                               capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return probe.returncode == 0 and probe.stdout == b"ok\n"
