"""The rollout engine as a seam (`rl_megatron/rollout/engine.py`): rollout.engine names a registered engine or the
config is refused; every registered engine has each operation of the `RolloutEngine` protocol with its signature; and
the shared code (workers, trainer, resharding, pre-flight) reaches an engine only through the protocol and the
registry, never by importing vLLM's engine modules."""
import ast
import importlib.util
import inspect

import pytest
from test_import_layers import PACKAGE, imports_of, module_name

from rl_megatron.errors import ConfigError
from rl_megatron.preflight import load_config
from rl_megatron.rollout.engine import ENGINES, RolloutEngine, engine_class

SHARED = ("workers", "trainer", "resharding", "preflight", "config", "planning")
# vllm_engine, vllm_weights, vllm_import, vllm_cpu_attention: the vLLM engine's own modules
ENGINE_MODULES = "rl_megatron.rollout.vllm"
# its names and facts that shared code once used
ENGINE_NAMES = ("VLLMEngine", "vllm_targets", "VLLM_LORA_RANKS", "check_cpu_attention", "CPU_ATTENTION_HEAD_SIZES")


def protocol_members() -> dict[str, object]:
    """The protocol's operations (its methods, `__init__` and `configure_process` included), by name."""
    return {name: value for name, value in vars(RolloutEngine).items()
            if (callable(value) or isinstance(value, staticmethod))
            and (not name.startswith("_") or name == "__init__")}


def test_an_unknown_engine_is_refused_naming_the_key_and_the_registered_engines():
    with pytest.raises(ConfigError, match=r"rollout.engine='sglang' is not a registered rollout engine "
                                          r"\(registered: vllm\).*add yours to rl_megatron/rollout/engine.py::ENGINES"):
        ENGINES.check("sglang")
    with pytest.raises(ConfigError, match=r"rollout.engine='sglang'"):  # at config time, before any worker starts
        load_config("configs/demo_cpu.yaml", ["rollout.engine=sglang"])
    assert load_config("configs/demo_cpu.yaml").rollout.engine == "vllm"


def test_the_protocol_has_every_operation_the_workers_call():
    assert set(protocol_members()) >= {
        "__init__", "configure_process", "generate", "serve", "interrupt", "sleep", "wake_up", "sync_targets",
        "weights_updated", "load_adapter", "adapter_mismatches", "release_process_groups", "close"}
    assert {"process_env", "sleeps", "lora_ranks", "adapters_on_output_layer", "preload"} <= set(
        RolloutEngine.__annotations__)


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_registered_engine_implements_the_protocol(name):
    engine = engine_class(name)
    for member, declared in protocol_members().items():
        implemented = inspect.getattr_static(engine, member, None)
        assert implemented is not None, f"{engine.__name__} has no {member}"
        assert isinstance(implemented, staticmethod) == isinstance(declared, staticmethod), member
        expected, actual = inspect.signature(getattr(RolloutEngine, member)), inspect.signature(getattr(engine, member))
        assert [(p.name, p.kind, p.default) for p in actual.parameters.values()] == [
            (p.name, p.kind, p.default) for p in expected.parameters.values()], f"{engine.__name__}.{member}{actual}"
    assert isinstance(engine.process_env, dict)
    assert list(engine.lora_ranks) == sorted(set(engine.lora_ranks)) and all(r > 0 for r in engine.lora_ranks)
    assert isinstance(engine.adapters_on_output_layer, bool)
    assert importlib.util.find_spec(engine.preload) is not None, engine.preload
    # `sleeps` is an instance attribute: one the class's methods set.
    methods = ast.parse(inspect.getsource(engine))
    assigned = {target.attr for node in ast.walk(methods) if isinstance(node, ast.Assign) for target in node.targets
                if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self"}
    assert "sleeps" in assigned


@pytest.mark.parametrize("package", SHARED)
def test_shared_code_reaches_the_engine_through_the_protocol_only(package):
    direct = {module: sorted(name for name in names if name.startswith(ENGINE_MODULES))
              for module, names in imports_of(package).items()}
    assert not {module: names for module, names in direct.items() if names}
    by_name = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            named = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if named in ENGINE_NAMES:
                by_name.append(f"{module_name(path)}:{node.lineno} {named}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(
                    ENGINE_MODULES):  # a module named by its path, e.g. to import it later
                by_name.append(f"{module_name(path)}:{node.lineno} names {node.value}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                by_name += [f"{module_name(path)}:{node.lineno} imports {m}" for m in modules
                            if m.partition(".")[0] == "vllm"]
    assert not by_name
