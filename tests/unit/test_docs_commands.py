"""Every command in README.md and docs/*.md is one a user can run as written, and every relative link resolves.

What counts as a command, and how each is checked (in this process, no training started):

- Commands are the lines of fenced blocks tagged ```bash (or sh, shell, console). A backslash continues a line; a
  `# comment` and blank lines are dropped; a line is split into words as the shell does (quotes removed), and
  NOT_CHECKED_HERE names a line by its words joined with single spaces, without its environment assignments. A
  command-like line (`python`, `.venv/bin/python`, `make`, `launch/`, `bash`, `pip`, `sbatch`) in a block of another
  tag, or untagged, fails: tag its block `bash`.
- Leading `NAME=value` environment assignments are not part of the command, nor is a wrapper before the project's
  own program (`nsys profile ...`, `docker run ... IMAGE`, `sbatch --nodes=4`). The project's program is the first of:
  * `python -m rl_megatron.X` (also `.venv/bin/python`): module X exists and its own argparse parser accepts the
    arguments (`--help` included); with `--config`, the config loads with its overrides (below).
  * `launch/train_3d.sh` or `launch/slurm_train_3d.sbatch` (also after `bash`): the script exists; its arguments
    ([--dry-run | --check] CONFIG key=value ...) parse with `python -m rl_megatron.launch prepare`'s parser, which
    the script hands them to, and the config loads with its overrides; `--help` is the script's own.
  * `make TARGET`: TARGET is a target of the Makefile, and the `-m rl_megatron.` commands of its recipe are checked
    as above.
  Any other line (a third-party tool, a shell loop) must be in NOT_CHECKED_HERE, with the test that runs it or why
  none does; a test file named there must exist.
- Placeholders, substituted before checking: `CONFIG` -> configs/demo_cpu.yaml; `[--flag]` -> `--flag`;
  `[key=value ...]`, `key=value` and `...` are dropped; `$NAME` -> SHELL_VARIABLES[NAME] (a loop's variable).
- Configs: paths relative to the repository root. `rl_megatron.preflight.load_config` (every key known, typed, in its
  range; derived values; the pre-flight checks of the model folder, data and the user's code) when the model folder
  is in the repository. A `model.path` outside it (a user's `/models/...` folder, not on this machine) is checked by
  `load` + `resolve` only: every key and value, not the folder's files. `my_pkg`, the guides' example of a user's
  package, is a stub package made here (`my_pkg.rewards`, `my_pkg.agent:rollout`).
- Inline code spans in the prose that start like a command (`python -m rl_megatron.`, `.venv/bin/python -m
  rl_megatron.`, a launch script, `make `) name an existing module, script or make target, and each `--flag` in them is
  one of that parser's options. A span naming a config key (`section.key`, `section.key=value`, `section.key: value`,
  `section.{a, b}`, in lower case; not a file name such as `moe.py`) names a key (or section) of the schema, and a
  span naming a path of the repository (`configs/...`, `tests/...`, `rl_megatron/...`, `launch/...`, `docs/...`,
  without placeholders such as `<name>` or `*`) names an existing file or folder (a package-relative one, as
  docs/architecture.md writes `launch/memory.py`, under rl_megatron/). A span that names a module of rl_megatron
  (`rollout.vllm_engine.x`), or something of the library a section is named after (`ray.get`), is code, not a
  config key.
- ```python blocks compile, and each name their `from rl_megatron... import` lines import exists.
- Links: every relative link `[text](target)` of README.md and docs/*.md resolves to an existing file, and a
  `#anchor` (alone or after a .md file) to a heading of that file (GitHub's slugs).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import os
import re
import shlex
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md"] + sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(REPO, "docs"))
                              if name.endswith(".md"))

COMMAND_TAGS = {"bash", "sh", "shell", "console"}
COMMAND_LIKE = re.compile(r"^\s*(\$ )?(python3?|\.venv/bin/python|make|launch/|bash|pip|sbatch)\b")
PLACEHOLDERS = {"CONFIG": "configs/demo_cpu.yaml"}
DROPPED = {"key=value", "...", "[key=value", "...]"}
SHELL_VARIABLES = {"coeff": "0.01"}  # docs/moe.md's sweep: `for coeff in 0 0.001 0.01 0.1`
LAUNCH_SCRIPTS = ("launch/train_3d.sh", "launch/slurm_train_3d.sbatch")
LAUNCH_SCRIPT_FLAGS = {"--dry-run", "--check", "--help", "-h"}

# Lines of ```bash blocks that are not the project's commands, each with the test that runs it or why none does.
NOT_CHECKED_HERE = {
    "tensorboard --logdir runs/": "TensorBoard's own command; tests/e2e/test_observability.py reads the event files "
                                  "it shows",
    "for coeff in 0 0.001 0.01 0.1; do": "a shell loop around a command checked here (with coeff=0.01)",
    "done": "the end of that shell loop",
    "pip install -e .[wandb]": "pip with setup.py's extras; the loggers they install: tests/unit/test_trackers.py",
    "wandb sync runs/demo_cpu/wandb/offline-run-*": "wandb's own command; tests/e2e/test_observability.py writes an "
                                                    "offline W&B run",
    "mlflow ui --backend-store-uri sqlite:///runs/mlflow.db": "MLflow's own command; tests/e2e/test_observability.py "
                                                              "writes the store it reads",
    "ray start --head": "Ray's own command; tests/e2e/test_launch_script.py starts a head the same way",
    "ray debug --address HOST:PORT": "Ray's legacy debugger; tests/integration/test_ray_debugger.py",
    "ssh -L 8265:localhost:8265 head-node": "an ssh port forward: not testable here",
    "ssh -L 8265:localhost:8265 node0": "an ssh port forward: not testable here",
    "pip install -r requirements-gpu.txt": "a GPU machine's install; tests/unit/test_stack.py checks that its pins "
                                           "are the CPU install's",
    "pip install --no-build-isolation transformer_engine[pytorch]>=2.9,<3": "a GPU machine's install; not run by "
                                                                            "a test (docs/gpu.md)",
    "pip install --no-deps -e .": "pip, as `make install` runs it; tests/process/test_installed_package.py imports the "
                                  "installed package outside the repository",
    "docker build -t rl_megatron:gpu .": "the Dockerfile has not been built (docs/gpu.md)",
    "docker run --gpus all --rm rl_megatron:gpu python -m pytest tests/gpu -m gpu -rA":
        "GPU only; tests/process/test_gpu_tests_collect.py collects tests/gpu on CPU",
}


# --- reading the documents ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    tag: str
    lines: list  # (line number, text)


def read(doc: str) -> str:
    with open(os.path.join(REPO, doc), encoding="utf-8") as f:
        return f.read()


def blocks_and_prose(doc: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced blocks of `doc`, and its other lines."""
    blocks, prose, current = [], [], None
    for number, text in enumerate(read(doc).splitlines(), 1):
        fence = re.match(r"^\s*```(\S*)", text)
        if fence and current is None:
            current = Block(doc, number, fence.group(1).lower(), [])
        elif fence:
            blocks.append(current)
            current = None
        elif current is not None:
            current.lines.append((number, text))
        else:
            prose.append((number, text))
    assert current is None, f"{doc}:{current.line}: a fence that is never closed"
    return blocks, prose


def logical_lines(block: Block):
    """(line number, text) of each command of a block: continuations joined, comments and blank lines dropped."""
    pending, start = "", None
    for number, text in block.lines:
        start = number if not pending else start
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        whole, pending = pending + text, ""
        tokens = shlex.split(whole, comments=True)
        if tokens:
            yield start, tokens


def without_environment(tokens: list[str]) -> list[str]:
    """`tokens` without the `NAME=value` assignments before the program."""
    while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
        tokens = tokens[1:]
    return tokens


def all_commands():
    found = []
    for doc in DOCS:
        for block in blocks_and_prose(doc)[0]:
            if block.tag in COMMAND_TAGS:
                for number, tokens in logical_lines(block):
                    found.append(pytest.param(tokens, " ".join(without_environment(tokens)), id=f"{doc}:{number}"))
    return found


def inline_spans():
    """(doc, line, text) of every inline code span outside fenced blocks."""
    for doc in DOCS:
        for number, text in blocks_and_prose(doc)[1]:
            for span in re.findall(r"`([^`\n]+)`", text):
                yield doc, number, span.strip()


# --- the project's command-line tools ----------------------------------------------------------------------------

def _no_arguments(argv):
    if argv:
        raise AssertionError(f"takes no arguments, given {argv}")
    return argparse.Namespace()


# module -> (the module holding its argument parsing, the function that parses argv): what `python -m module ARGS`
# runs first. A function named build_parser or parser returns the parser instead.
CLIS = {"rl_megatron.train": ("rl_megatron.train", "parse_args"),
        "rl_megatron.doctor": ("rl_megatron.doctor.__main__", "parse_args"),
        "rl_megatron.convert": ("rl_megatron.convert", "parser"),
        "rl_megatron.data.prepare": ("rl_megatron.data.prepare", "parse_args"),
        "rl_megatron.bench": ("rl_megatron.bench.__main__", "parse_args"),
        "rl_megatron.models.tiny": ("rl_megatron.models.tiny", "build_parser"),
        "rl_megatron.launch": ("rl_megatron.launch.__main__", "parse_args"),
        "rl_megatron.platform.stack": None}  # takes no arguments


def _parse_with(module: str, argv: list[str]) -> argparse.Namespace:
    if CLIS[module] is None:
        return _no_arguments(argv)
    holder, name = CLIS[module]
    function = getattr(importlib.import_module(holder), name)
    return function().parse_args(argv) if name in ("parser", "build_parser") else function(argv)


def parse(module: str, argv: list[str]) -> argparse.Namespace | None:
    """The namespace `module`'s parser makes of `argv`; None for `--help` (it exits 0). Fails on what it refuses."""
    assert module in CLIS, f"{module}: not a command-line tool this test knows (add it to CLIS)"
    assert importlib.util.find_spec(module) is not None, f"no module {module}"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            return _parse_with(module, argv)
    except SystemExit as exit_:
        if exit_.code in (0, None):
            return None
        pytest.fail(f"python -m {module} {shlex.join(argv)}: refused by its parser: {stderr.getvalue().strip()}")


def parser_of(module: str) -> argparse.ArgumentParser:
    """The parser `module` builds (caught as its parse_args is called)."""
    caught = []

    class Caught(Exception):
        pass

    def catch(self, *args, **kwargs):
        caught.append(self)
        raise Caught

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = catch
    try:
        _parse_with(module, [])
    except Caught:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original
    assert caught, f"{module} builds no argparse parser"
    return caught[0]


def option_strings(parser: argparse.ArgumentParser, subcommand: str | None) -> set[str]:
    """`parser`'s options, with those of `subcommand` (or of every subcommand when it is None)."""
    options = {"-h", "--help"}
    for action in parser._actions:
        options.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if subcommand in (None, name):
                    options |= option_strings(sub, None)
    return options


# --- configs ------------------------------------------------------------------------------------------------------

@pytest.fixture
def repo_root(monkeypatch, tmp_path):
    """The repository's root as the working directory, and the guides' example user package `my_pkg` importable."""
    monkeypatch.chdir(REPO)
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rewards.py").write_text('"""The guides\' example of a module of scorers (none registered here)."""\n')
    (package / "agent.py").write_text("def rollout(engines, prompts, sampling):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [name for name in sys.modules if name == "my_pkg" or name.startswith("my_pkg.")]:
        del sys.modules[name]


def check_config(config: str, overrides: list[str]) -> None:
    from rl_megatron.config import ConfigError, load
    from rl_megatron.preflight import load_config, resolve

    assert os.path.isfile(config), f"--config {config}: no such file in the repository"
    try:
        model_path = load(config, overrides).model.path
        if os.path.isdir(model_path) and not os.path.isabs(model_path):
            load_config(config, overrides)
        else:  # a user's model folder, not on this machine: every key and value, not the folder's files
            resolve(load(config, overrides))
    except ConfigError as err:
        pytest.fail(f"{config} {shlex.join(overrides)}: {err}")


# --- one command --------------------------------------------------------------------------------------------------

def substitute(tokens: list[str]) -> list[str]:
    out = []
    for token in tokens:
        if token in DROPPED:
            continue
        token = re.sub(r"^\[(--[\w-]+)\]$", r"\1", token)
        token = re.sub(r"\$(\w+)", lambda m: SHELL_VARIABLES[m.group(1)], token)
        out.append(PLACEHOLDERS.get(token, token))
    return out


def python_module_at(tokens: list[str]) -> int | None:
    """Where `python -m rl_megatron.X` starts in `tokens`, if anywhere."""
    for i, token in enumerate(tokens[:-2]):
        if re.fullmatch(r"(\S*/)?python(3(\.\d+)?)?", token) and tokens[i + 1] == "-m" and \
                tokens[i + 2].startswith("rl_megatron"):
            return i
    return None


def check_python(tokens: list[str]) -> None:
    module, argv = tokens[2], tokens[3:]
    args = parse(module, argv)
    if args is not None and getattr(args, "config", None):
        check_config(args.config, list(getattr(args, "overrides", [])))


def check_launch(script: str, argv: list[str]) -> None:
    assert os.path.isfile(os.path.join(REPO, script)), f"{script}: no such script"
    if argv and argv[0] in ("--help", "-h"):
        return
    args = parse("rl_megatron.launch", ["prepare", *argv])
    check_config(args.config, list(args.overrides))


def make_targets() -> dict[str, list[str]]:
    """The Makefile's targets, each with its recipe's lines."""
    targets, current = {}, None
    for text in read("Makefile").splitlines():
        if text.startswith("\t") and current is not None:
            for name in current:
                targets[name].append(text.strip())
            continue
        rule = re.match(r"^([A-Za-z0-9_.$()/ -]+?)\s*::?(?!=)(.*)$", text)
        current = None
        if rule and not text.startswith((".", "#")):
            current = rule.group(1).split()
            for name in current:
                targets.setdefault(name, [])
    return targets


def check_make(argv: list[str]) -> None:
    targets = make_targets()
    names = [a for a in argv if not a.startswith("-") and "=" not in a]
    assert names, "make without a target"
    for name in names:
        assert name in targets, f"make {name}: no such target in the Makefile (targets: {sorted(targets)})"
        for recipe in targets[name]:
            tokens = shlex.split(recipe.replace("$(PY)", "python"))
            start = python_module_at(tokens)
            if start is not None:
                check_python(tokens[start:])


def check_command(tokens: list[str], text: str) -> None:
    tokens = without_environment(substitute(tokens))
    start = python_module_at(tokens)
    if start is not None:
        return check_python(tokens[start:])
    for i, token in enumerate(tokens):
        if token in LAUNCH_SCRIPTS or token.lstrip("./") in LAUNCH_SCRIPTS:
            return check_launch(token.lstrip("./"), tokens[i + 1:])
        if token.startswith("launch/"):
            pytest.fail(f"{token}: not a launch script this test knows ({LAUNCH_SCRIPTS})")
    if tokens and tokens[0] == "make":
        return check_make(tokens[1:])
    assert text in NOT_CHECKED_HERE, (
        f"`{text}` is neither the project's command nor listed in NOT_CHECKED_HERE (with the test that runs it)")


@pytest.mark.parametrize("tokens, text", all_commands())
def test_command(tokens, text, repo_root):
    check_command(tokens, text)


def test_every_line_listed_as_not_checked_is_in_a_document_and_names_existing_tests():
    lines = {param.values[1] for param in all_commands()}
    for line, where in NOT_CHECKED_HERE.items():
        assert line in lines, f"NOT_CHECKED_HERE lists `{line}`, which no document has any more: remove it"
        for test_file in re.findall(r"tests/[\w/]+\.py", where):
            assert os.path.isfile(os.path.join(REPO, test_file)), f"`{line}`: {test_file} does not exist"


def test_commands_are_only_in_bash_blocks():
    for doc in DOCS:
        for block in blocks_and_prose(doc)[0]:
            if block.tag in COMMAND_TAGS:
                continue
            for number, text in block.lines:
                assert not COMMAND_LIKE.match(text), (
                    f"{doc}:{number}: `{text.strip()}` looks like a command in a ```{block.tag} block; tag the "
                    "block bash so that it is checked")


def test_the_documents_have_commands_to_check():
    assert len(all_commands()) >= 60, "the command extraction found too few: is the rule still right?"


# --- inline commands and config keys in the prose ------------------------------------------------------------------

def test_inline_commands_name_existing_modules_scripts_targets_and_flags():
    targets = make_targets()
    checked = 0
    for doc, number, span in inline_spans():
        where = f"{doc}:{number}: `{span}`"
        tokens = span.replace("[", " ").replace("]", " ").split()
        start = python_module_at(tokens)
        if start is not None:
            module, rest = tokens[start + 2], tokens[start + 3:]
            assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
            if module not in CLIS:  # an internal entry point (e.g. the reward scorer's process): no user flags
                checked += 1
                continue
            options = option_strings(parser_of(module), rest[0] if rest and not rest[0].startswith("-") else None)
        elif tokens and tokens[0].lstrip("./") in LAUNCH_SCRIPTS:
            assert os.path.isfile(os.path.join(REPO, tokens[0])), f"{where}: no such script"
            rest, options = tokens[1:], LAUNCH_SCRIPT_FLAGS
        elif tokens and tokens[0] == "make" and len(tokens) > 1:
            assert tokens[1] in targets, f"{where}: no make target {tokens[1]}"
            checked += 1
            continue
        else:
            continue
        checked += 1
        for token in rest:
            if token.startswith("--"):
                assert token.split("=")[0] in options, f"{where}: {token.split('=')[0]} is not an option"
    assert checked >= 20


def schema_keys() -> set[str]:
    """Every key of the config schema, sections included (`actor.optim`, `actor.optim.lr`)."""
    from omegaconf import DictConfig, OmegaConf
    from rl_megatron.config import Config

    keys = set()

    def walk(node, prefix):
        for name in node.keys():
            keys.add(prefix + name)
            child = node._get_node(name)
            if isinstance(child, DictConfig):
                walk(child, prefix + name + ".")

    walk(OmegaConf.structured(Config), "")
    return keys


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def library_attribute(dotted: str) -> bool:
    """Whether `dotted` names something in an installed library of the same name as a config section (`ray.get`)."""
    first, *rest = dotted.split(".")
    if not is_module(first):
        return False
    target = importlib.import_module(first)
    for name in rest:
        if not hasattr(target, name) and not is_module(f"{target.__name__}.{name}"):
            return False
        target = getattr(target, name, None) or importlib.import_module(f"{target.__name__}.{name}")
    return True


def test_config_keys_named_in_the_prose_exist():
    keys = schema_keys()
    sections = {key for key in keys if "." not in key}
    pattern = re.compile(rf"^((?:{'|'.join(sorted(sections))})(?:\.[a-z_][a-z0-9_]*)+)(?:\.\{{([^}}]*)\}})?"
                         r"(?:(?:=|: ).*)?$")
    checked = 0
    for doc, number, span in inline_spans():
        match = pattern.match(span)
        if not match or re.search(r"\.(py|ya?ml|jsonl?|md|txt|pt|sh|parquet)$", span):  # a file, e.g. `moe.py`
            continue
        named = [match.group(1)]
        if is_module("rl_megatron." + ".".join(named[0].split(".")[:2])):  # `rollout.vllm_engine.x`: code, not a key
            continue
        if named[0] not in keys and library_attribute(named[0]):  # `ray.get`: the library, not the `ray` section
            continue
        if match.group(2):  # section.{a, b: x|y}
            named = [f"{match.group(1)}.{item.split(':')[0].strip()}" for item in match.group(2).split(",")]
        for key in named:
            checked += 1
            assert key in keys, f"{doc}:{number}: `{span}` names {key}, which is no key of the config schema"
    assert checked >= 100


def test_repository_paths_named_exist():
    checked = 0
    for doc, number, span in inline_spans():
        path = span.split()[0] if span.split() else ""
        if not re.match(r"^(configs|tests|rl_megatron|launch|docs)/", path) or re.search(r"[<>*{}\[\]]", path):
            continue
        path = path.rstrip(",;:)")
        checked += 1
        assert os.path.exists(os.path.join(REPO, path)) or os.path.exists(os.path.join(REPO, "rl_megatron", path)), \
            f"{doc}:{number}: `{span}`: {path} does not exist (in the repository or in rl_megatron/)"
    assert checked >= 50


# --- python examples ----------------------------------------------------------------------------------------------

def test_python_examples_compile_and_their_imports_exist():
    for doc in DOCS:
        for block in blocks_and_prose(doc)[0]:
            if block.tag != "python":
                continue
            source = "\n".join(text for _, text in block.lines)
            compile(source, f"{doc}:{block.line}", "exec")
            for module, names in re.findall(r"^from (rl_megatron[\w.]*) import ([^\n(]+)$", source, re.M):
                imported = importlib.import_module(module)
                for name in (n.strip() for n in names.split(",")):
                    assert hasattr(imported, name), f"{doc}:{block.line}: {module} has no {name}"


# --- links --------------------------------------------------------------------------------------------------------

def heading_anchors(doc: str) -> set[str]:
    """GitHub's anchors of `doc`'s headings (outside fenced blocks)."""
    anchors, seen = set(), {}
    for _, text in blocks_and_prose(doc)[1]:
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", text)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_relative_links_resolve():
    checked = 0
    for doc in DOCS:
        for number, text in blocks_and_prose(doc)[1]:
            for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", text)):
                if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                resolved = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
                assert os.path.exists(os.path.join(REPO, resolved)), f"{doc}:{number}: {target} does not exist"
                if anchor and resolved.endswith(".md"):
                    assert anchor in heading_anchors(resolved), f"{doc}:{number}: {target}: no heading #{anchor}"
                checked += 1
    assert checked >= 30


def test_the_readme_stays_short():
    assert len(read("README.md").splitlines()) <= 350
