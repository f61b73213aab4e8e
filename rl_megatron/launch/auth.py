"""Ray's token authentication for the launcher's cluster: on unless RAY_AUTH_MODE=disabled, one token for all nodes.

Ray 2.60 takes the mode from RAY_AUTH_MODE (only from the environment) and the token from RAY_AUTH_TOKEN, else the
file RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token. Every process that talks to the cluster presents it: `ray
start` on each node, the trainer's and the doctor's `ray.init(address="auto")`, and Ray's own workers, which inherit
their raylet's environment. `ray start` never makes a token, so the launcher does: node 0 writes it to a file the
other nodes read (by default in the run directory, which must then be on storage every node sees)."""
from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from typing import Mapping, Optional

from rl_megatron.errors import LaunchError

TOKEN_FILE = "ray_auth_token"  # in the run directory, beside logs/ and the checkpoints


@dataclass(frozen=True)
class RayAuth:
    mode: str  # RAY_AUTH_MODE for every Ray process of the run: "token" or "disabled"
    token_file: Optional[str]  # absolute; None when the token is in RAY_AUTH_TOKEN or auth is off
    source: str  # for the plan: where the token comes from (never the token itself)

    def exports(self) -> list[str]:
        """NAME=value for the launcher to export: Ray's commands and the trainer read them."""
        return [f"RAY_AUTH_MODE={self.mode}"] + ([f"RAY_AUTH_TOKEN_PATH={self.token_file}"] if self.token_file else [])


def ray_auth(env: Mapping[str, str], run_dir: str) -> RayAuth:
    """The run's authentication from RAY_AUTH_MODE / RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH, in Ray's precedence."""
    mode = env.get("RAY_AUTH_MODE") or "token"
    if mode == "disabled":
        return RayAuth(mode, None, "OFF (RAY_AUTH_MODE=disabled) - insecure: anyone who can reach the head's Ray "
                                   "ports can run code on every node")
    if mode != "token":
        raise LaunchError(f"RAY_AUTH_MODE='{mode}': the launcher runs Ray with token authentication (RAY_AUTH_MODE "
                          "unset or 'token') or, insecurely, without (RAY_AUTH_MODE=disabled).")
    if env.get("RAY_AUTH_TOKEN"):
        return RayAuth(mode, None, "token from RAY_AUTH_TOKEN (every node's environment must carry the same one)")
    given = env.get("RAY_AUTH_TOKEN_PATH")
    path = os.path.abspath(os.path.expanduser(given or os.path.join(run_dir, TOKEN_FILE)))
    return RayAuth(mode, path, f"token file {path} ({'RAY_AUTH_TOKEN_PATH' if given else 'in the run directory'}; "
                               "node 0 writes it, mode 0600, if it is missing; the other nodes read it, so it must "
                               "be on storage they share)")


def write_token_file(path: str) -> None:
    """Node 0: a new random token in `path`, readable by its owner only. A file that already holds one is kept (the
    same command resumes with the same token), unless others can read it: then the token is no secret."""
    if os.path.isfile(path) and os.path.getsize(path) > 0:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            raise LaunchError(f"The Ray token file {path} can be read by other users (mode {mode:04o}), and whoever "
                              f"reads it can run code on the cluster: `chmod 600 {path}`, or delete it for a new one.")
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32))  # 256 bits, as `ray get-auth-token --generate` makes
    os.replace(partial, path)  # the other nodes never read half a token
