"""The user's code, named in the config: `pkg.module:name` or `path/to/file.py:name` for a function (the rollout
function, the reward function), and `trainer.imports` for modules imported for what they register
(`@rl_megatron.rewards.register`) in every process of a run: the controller, the Ray workers and the scorer
processes; `module_process` starts such a process (a scorer's, an agent worker's) where the controller's imports
import too."""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType

from rl_megatron.errors import ConfigError

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds rl_megatron/


def import_module(name: str, key: str) -> ModuleType:
    """The module `name` (dotted, or a .py file's path); raises ConfigError naming config key `key`."""
    if name.endswith(".py"):
        return _module_from_file(name, key)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        raise ConfigError(f"{key}: module {err.name!r} was not found. Install it or put its folder on PYTHONPATH "
                          "(the workers and scorer processes inherit it).") from None
    except Exception as err:
        raise ConfigError(f"{key}: importing module {name!r} failed with {type(err).__name__}: {err}. "
                          "Fix the module.") from None


def import_user_modules(names: list[str], key: str = "trainer.imports") -> None:
    """Import each module of `names` (once per process; a module already imported is not run again)."""
    for name in names:
        import_module(with_absolute_path(name), f"{key} entry {name!r}")


def load_callable(spec: str, key: str) -> Callable:
    """The function `spec` ('package.module:function' or 'path/to/file.py:function') names."""
    module_name, colon, function_name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not colon or not module_name or not function_name:
        raise ConfigError(f"{key}={spec!r} must be 'package.module:function' or 'path/to/file.py:function', "
                          "e.g. my_pkg.my_module:my_function.")
    module = import_module(module_name, f"{key}={spec!r}")
    function = getattr(module, function_name, None)
    if function is None:
        raise ConfigError(f"{key}={spec!r}: module {module_name!r} has no attribute {function_name!r}. Check the "
                          "name after the ':'.")
    if not callable(function):
        raise ConfigError(f"{key}={spec!r}: {function_name!r} in {module_name!r} is a "
                          f"{type(function).__name__}, not a function.")
    return function


def _module_from_file(path: str, key: str) -> ModuleType:
    if not os.path.isfile(path):
        raise ConfigError(f"{key}: file {path!r} was not found (relative paths start from {os.getcwd()}). Give an "
                          "existing .py file.")
    name = "_rl_megatron_user_" + os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == os.path.abspath(path):
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look a class's module up there
    try:
        loader_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ConfigError(f"{key}: running {path!r} failed with {type(err).__name__}: {err}. Fix the file.") from None
    return module


def with_absolute_path(spec: str) -> str:
    """A spec (or module name) with a file path made absolute, so that processes started elsewhere find it."""
    module_name, colon, rest = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if not module_name.endswith(".py"):
        return spec
    return f"{os.path.abspath(module_name)}{colon}{rest}"


def module_process(module: str, args: list[str], pass_fds: tuple[int, ...]) -> subprocess.Popen:
    """`python -m module *args` in a fresh interpreter (not a fork of the controller, nor multiprocessing's spawn,
    which re-imports the controller's main module and torch with it), passed `pass_fds`. The folder holding
    rl_megatron, then the controller's sys.path go first on its PYTHONPATH, so what the controller imports (the
    user's package on a folder added at run time) imports there too. Its own session: Ctrl-C stays the controller's,
    and killing the group also ends the process's children."""
    paths = [PACKAGE_ROOT, *(p or os.getcwd() for p in sys.path), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(p for p in paths if p))}
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env, pass_fds=pass_fds,
                            stdin=subprocess.DEVNULL, start_new_session=True)
