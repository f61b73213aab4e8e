"""The package layers, read from the source's imports: config is the floor (it imports nothing of rl_megatron but
the leaf modules errors, roles and registry, and no config type needs a TYPE_CHECKING guard to be imported); the
leaves import nothing of rl_megatron but one another (registry: errors); nothing below
workers/ imports it; the planner (planning/) imports none of the drivers that read it, and nothing imports the
launcher (launch/, the top). And importing the schema in a fresh interpreter loads a handful of modules, none of torch,
Ray, vLLM or Megatron."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import REPO

PACKAGE = Path(REPO) / "rl_megatron"
# Import nothing of rl_megatron but one another: any package may use them.
LEAF_MODULES = ("rl_megatron.errors", "rl_megatron.roles", "rl_megatron.registry")
BELOW_WORKERS = ("rollout", "resharding", "models", "platform", "planning", "algorithms", "data", "rewards")
# The drivers above the planner: launch/ and the trainer print the plan, preflight/ and the doctor check against it.
PLAN_READERS = ("rl_megatron.launch", "rl_megatron.preflight", "rl_megatron.trainer", "rl_megatron.doctor",
                "rl_megatron.bench")
HEAVY = ("torch", "ray", "vllm", "megatron")
MAX_MODULES_FOR_THE_SCHEMA = 12


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST) -> set[str]:
    """The rl_megatron modules `tree` imports anywhere (top level, functions, guards); `from rl_megatron import x`
    counts as rl_megatron.x."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "rl_megatron":
                found.update(f"rl_megatron.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
    return {name for name in found if name == "rl_megatron" or name.startswith("rl_megatron.")}


def imports_of(package: str) -> dict[str, set[str]]:
    """Each module of `package` (a folder of rl_megatron, or a leaf module's name) -> the rl_megatron modules it
    imports."""
    folder = PACKAGE / package
    paths = sorted(folder.rglob("*.py")) if folder.is_dir() else [PACKAGE / f"{package}.py"]
    return {module_name(path): imported_modules(ast.parse(path.read_text(), str(path))) for path in paths}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_config_imports_nothing_of_rl_megatron_but_itself_and_the_leaf_modules():
    outside = {module: sorted(name for name in names if not within(name, "rl_megatron.config")
                              and name not in LEAF_MODULES)
               for module, names in imports_of("config").items()}
    assert not {module: names for module, names in outside.items() if names}
    assert {leaf: imports_of(leaf.rpartition(".")[2])[leaf] for leaf in LEAF_MODULES} == {
        "rl_megatron.errors": set(), "rl_megatron.roles": set(), "rl_megatron.registry": {"rl_megatron.errors"}}


def test_no_type_checking_guard_imports_a_config_type():
    guarded = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                guarded += [f"{module_name(path)}: {name}" for name in imported_modules(ast.Module(node.body, []))
                            if within(name, "rl_megatron.config")]
    assert not guarded


@pytest.mark.parametrize("package", BELOW_WORKERS)
def test_nothing_below_workers_imports_them(package):
    upward = {module: sorted(name for name in names if within(name, "rl_megatron.workers"))
              for module, names in imports_of(package).items()}
    assert not {module: names for module, names in upward.items() if names}


def test_the_planner_imports_none_of_the_drivers_that_read_it():
    upward = {module: sorted(name for name in names if any(within(name, reader) for reader in PLAN_READERS))
              for module, names in imports_of("planning").items()}
    assert not {module: names for module, names in upward.items() if names}


def test_nothing_imports_the_launcher():
    importers = {module_name(path): sorted(name for name in imported_modules(ast.parse(path.read_text(), str(path)))
                                           if within(name, "rl_megatron.launch"))
                 for path in sorted(PACKAGE.rglob("*.py")) if not within(module_name(path), "rl_megatron.launch")}
    assert not {module: names for module, names in importers.items() if names}


def test_the_schema_alone_loads_a_handful_of_modules_and_no_framework():
    script = ("import json, sys\n"
              "import rl_megatron.config.schema\n"
              "print(json.dumps(sorted(sys.modules)))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout)
    ours = [name for name in loaded if within(name, "rl_megatron")]
    assert len(ours) <= MAX_MODULES_FOR_THE_SCHEMA, ours
    assert not [name for name in loaded if name.partition(".")[0] in HEAVY]
