"""Loading the user's own scorer from `reward.custom_fn`.

The spec is `package.module:function` (imported like any module) or `path/to/file.py:function` (loaded from
the file, as verl's custom_reward_function.path does). The function is called for every sample as
`fn(data_source, solution_str, ground_truth, extra_info)` - verl's custom reward signature - and returns a
number (or a dict with a "score" entry). To reuse a built-in scorer for some sources, call
`rl_megatron.rewards.score(data_source, solution_str, ground_truth)` from it.
"""
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable

from rl_megatron.errors import ConfigError

CustomRewardFn = Callable[[str, str, object, object], float]
KEY = "reward.custom_fn"


def load_custom_fn(spec: str) -> CustomRewardFn:
    """The function `spec` names; raises ConfigError naming reward.custom_fn and what was not found."""
    module_name, colon, function_name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not colon or not module_name or not function_name:
        raise ConfigError(f"{KEY}={spec!r} must be 'package.module:function' or 'path/to/file.py:function', "
                            "e.g. my_pkg.my_reward:compute_score.")
    if module_name.endswith(".py"):
        module = _module_from_file(spec, module_name)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            raise ConfigError(f"{KEY}={spec!r}: module {err.name!r} was not found. Install it or put its folder on "
                                "PYTHONPATH (the scorer processes inherit it).") from None
        except Exception as err:
            raise ConfigError(f"{KEY}={spec!r}: importing module {module_name!r} failed with "
                                f"{type(err).__name__}: {err}. Fix the module.") from None
    function = getattr(module, function_name, None)
    if function is None:
        raise ConfigError(f"{KEY}={spec!r}: module {module_name!r} has no attribute {function_name!r}. Check the "
                            "name after the ':'.")
    if not callable(function):
        raise ConfigError(f"{KEY}={spec!r}: {function_name!r} in {module_name!r} is a "
                            f"{type(function).__name__}, not a function.")
    return function


def _module_from_file(spec: str, path: str):
    if not os.path.isfile(path):
        raise ConfigError(f"{KEY}={spec!r}: file {path!r} was not found (relative paths start from "
                            f"{os.getcwd()}). Give an existing .py file.")
    name = "_rl_megatron_custom_reward_" + os.path.splitext(os.path.basename(path))[0]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look a class's module up there
    try:
        loader_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ConfigError(f"{KEY}={spec!r}: running {path!r} failed with {type(err).__name__}: {err}. "
                            "Fix the file.") from None
    return module


def with_absolute_path(spec: str) -> str:
    """The spec with a file path made absolute, so scorer processes find it whatever their working folder."""
    module_name, _, function_name = spec.rpartition(":")
    return f"{os.path.abspath(module_name)}:{function_name}" if module_name.endswith(".py") else spec
