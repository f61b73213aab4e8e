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
  the namespace (and created in it: nothing on the host, nothing to leak); read-only binds of `/usr` (and the
  interpreter's prefix, when outside it) with their package folders (site-packages, dist-packages) hidden, and of
  /dev/null and /dev/urandom; a /proc of its own PID namespace. No /etc, /home, /root,
  project, checkpoints or other processes' command lines;
- with no new privileges and no capabilities (`setpriv`): it cannot remount, unmount or change its limits' ceiling.

This is the pattern of bubblewrap and nsjail, built from util-linux alone so that it works wherever `unshare` does
(pip installs nothing for it). Where the kernel refuses unprivileged user namespaces (Docker's default seccomp
profile, some distributions), `available()` is False and the tools that need it refuse to start, saying so.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
import shutil
import subprocess
import sys

PR_SET_PDEATHSIG = 1

# Runs as the user namespace's root, in the new mount and PID namespaces: builds the root on a tmpfs mounted over
# /tmp (in this mount namespace only: nothing is created on the host, so nothing can leak), then hands over to the
# command without capabilities. $1: chroot; $2: the tmpfs's size in MiB; then read-only binds, "--hide" and folders
# covered by an empty read-only tmpfs (site-packages), "--links" and the top-level links to copy (/bin -> usr/bin),
# "--" and the command.
_SETUP = r'''
set -e
chroot=$1; size=$2; shift 2
root=/tmp
mount -t tmpfs -o "size=${size}m,mode=755,nosuid,nodev" sandbox "$root"
# As few processes as it can (a trivial call's start-up is mostly these): the folders, the binds, the hidden
# folders, the top-level links (/bin -> usr/bin, ...), two devices, /proc.
mkdir -p "$root/work" "$root/tmp" "$root/dev/shm" "$root/proc"
while [ "$1" != "--hide" ]; do
  mkdir -p "$root$1"
  mount -o bind,ro,nosuid,nodev "$1" "$root$1"
  shift
done
shift
while [ "$1" != "--links" ]; do mount -t tmpfs -o ro,size=0,nosuid,nodev,noexec hidden "$root$1"; shift; done
shift
while [ "$1" != "--" ]; do cp -P "$1" "$root/"; shift; done
shift
for device in null urandom; do
  : > "$root/dev/$device"
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


@functools.cache
def read_only_binds() -> tuple[list[str], list[str]]:
    """What the new root shows of the host, read-only: /usr, and the interpreter's prefix when it lies elsewhere (a
    pyenv or conda interpreter); and the package folders inside them, which it hides (the interpreter runs with its
    standard library only: no package of the trainer's environment is readable)."""
    binds = ["/usr"]
    prefix = os.path.realpath(sys.base_prefix)
    if not (prefix + "/").startswith("/usr/"):
        binds.append(prefix)
    patterns = ("lib/python3*/site-packages", "lib/python3*/dist-packages", "lib/python3/dist-packages",
                "local/lib/python3*/site-packages", "local/lib/python3*/dist-packages")
    hidden = sorted({os.path.realpath(found) for bind in binds for pattern in patterns
                     for found in glob.glob(os.path.join(bind, pattern)) if os.path.isdir(found)})
    return binds, [folder for folder in hidden if any((folder + "/").startswith(bind + "/") for bind in binds)]


def isolated(command: list[str], size_mb: int) -> list[str]:
    """`command` run inside the boundary, from / (it changes to /work itself); `size_mb`: the private tmpfs's size
    (/work, /tmp and /dev/shm together)."""
    unshare, sh, chroot = _tools()
    binds, hidden = read_only_binds()
    links = [f"/{name}" for name in ("bin", "lib", "lib64", "sbin") if os.path.islink(f"/{name}")]
    return [unshare, "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--mount", "--net", "--ipc",
            "--uts", sh, "-c", _SETUP, "sandbox-setup", chroot, str(size_mb), *binds, "--hide", *hidden, "--links",
            *links, "--", *command]


def die_with_parent() -> None:
    """For a child between fork and exec (subprocess's preexec_fn): SIGKILL when the process that started it ends."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 9)


@functools.cache
def available() -> bool:
    """Whether the boundary can be set up here: one trivial program run through it (probed once per process)."""
    if _tools() is None:
        return False
    interpreter = os.path.realpath(sys._base_executable)
    try:
        probe = subprocess.run(isolated([interpreter, "-I", "-S", "-c", "print('ok')"], 1), capture_output=True,
                               timeout=30, env={"PATH": "/usr/bin:/bin"}, cwd="/")
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0 and probe.stdout == b"ok\n"
