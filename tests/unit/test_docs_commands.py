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
  (and a teacher's or reward model's, `teacher.model.path`, `reward_model.model.path`) is in the repository. A
  `model.path` outside it (a user's `/models/...` folder, not on this machine), or a teacher's or reward model's
  folder that an earlier command of the guide makes, is checked by
  `load` + `resolve` only: every key and value, not the folders' files. `my_pkg`, the guides' example of a user's
  package, is a stub package made here (`my_pkg.rewards`, `my_pkg.agent:rollout`).
- Inline code spans in the prose that start like a command (`python -m rl_megatron.`, `.venv/bin/python -m
  rl_megatron.`, a launch script, `make `) name an existing module, script or make target, and each `--flag` in them is
  one of that parser's options. A span naming a config key (`section.key`, `section.key=value`, `section.key: value`,
  `section.{a, b}`, in lower case; not a file name such as `moe.py`) names a key (or section) of the schema, and a
  span naming a path of the repository (`configs/...`, `tests/...`, `rl_megatron/...`, `launch/...`, `docs/...`,
  without placeholders such as `<name>` or `*`) names an existing file or folder (a package-relative one, as
  docs/architecture.md writes `planning/memory.py`, under rl_megatron/). A span that names a module of rl_megatron
  (`rollout.vllm_engine.x`), or something of the library a section is named after (`ray.get`), is code, not a
  config key.
- ```python blocks compile, and each name their `from rl_megatron... import` lines import exists.
- Links: every relative link `[text](target)` of README.md and docs/*.md resolves to an existing file, and a
  `#anchor` (alone or after a .md file) to a heading of that file (GitHub's slugs).
- Names of the code: a span naming rl_megatron's code names something that exists, read from the source (nothing
  imported). Such a span is `rl_megatron.a.b` or `rl_megatron.a.b:name`; a file and names, `a/b.py::Name.member` or
  `a/b.Name`; `Class.member` where rl_megatron has a class of that name; or `a.b.c` in lower case whose leading
  parts end the dotted name of one of its modules (`spawn.run_distributed`; where `a` is also a config section,
  only when `a.b` is a module: `rollout.n` is a key). A call's parentheses are dropped. Library names (`ray.get`),
  config keys and variables are none of these and not checked (`code_reference` has the rules).
- Figures: a measured figure lives in docs/benchmarks.md, with its date, machine and command. A FIGURE (a number
  with a unit of time, throughput, memory, `%`, or a ratio such as `1.08×`) in the prose of any other document
  sits in a unit of text (a paragraph, a list item, a heading, or a table with the paragraph above it) that links
  to docs/benchmarks.md, unless NOT_MEASURED names the unit, by a phrase of it, as one whose figures are no
  measurement (defaults, timeouts, computed memory plans, device sizes).
- docs/architecture.md opens with its map (ARCHITECTURE_MAP's sections, within 80 lines); each later section fits
  a screen (60 lines).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
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
        "rl_megatron.models.tiny_reward_model": ("rl_megatron.models.tiny_reward_model", "build_parser"),
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
        cfg = load(config, overrides)
        folders = [cfg.model.path, *(path for path in (cfg.teacher.model.path, cfg.reward_model.model.path) if path)]
        if all(os.path.isdir(folder) and not os.path.isabs(folder) for folder in folders):
            load_config(config, overrides)
        else:  # a user's model folder (or one that a command before makes), not on this machine: every key
            resolve(cfg)  # and value, not the folders' files
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
    """Every key of the config schema, sections included (`actor.optim`, `actor.optim.lr`), and the built-in
    extensions' own keys (`actor.clip_cov`, `actor.clip_cov.ratio`)."""
    from omegaconf import DictConfig, OmegaConf
    from rl_megatron.config import Config
    from rl_megatron.config.extensions import resolve_extension_keys
    from rl_megatron.preflight.resolve import EXTENSIBLE

    keys = set()

    def walk(node, prefix):
        for name in node.keys():
            keys.add(prefix + name)
            child = node._get_node(name)
            if isinstance(child, DictConfig):
                walk(child, prefix + name + ".")

    walk(OmegaConf.structured(Config), "")
    for key in resolve_extension_keys({}, EXTENSIBLE):
        keys |= {key, key.rpartition(".")[0]}
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
        path = path.split("::")[0].rstrip(",;:)")  # `rl_megatron/x.py::name`: the name is test_code_named_...'s
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


# --- names of the code ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ClassInfo:
    members: set  # what its body defines (methods, fields, nested classes) and what its methods assign to self.X
    bases: list  # the names of its bases as written (the last part of a dotted base)


@dataclasses.dataclass
class ModuleInfo:
    names: set  # its top-level definitions, assignments and imports (under if/try too)
    classes: dict  # name -> ClassInfo


def _top_level(statements):
    for node in statements:
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            for body in (node.body, node.orelse, getattr(node, "finalbody", []),
                         *[handler.body for handler in getattr(node, "handlers", [])]):
                yield from _top_level(body)


def _assigned(node) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = []
    for target in targets:
        names += [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
    return names


def _class_info(node: ast.ClassDef) -> ClassInfo:
    members = set()
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(child.name)
        elif isinstance(child, (ast.Assign, ast.AnnAssign)):
            members.update(_assigned(child))
    for child in ast.walk(node):
        if isinstance(child, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in (child.targets if isinstance(child, ast.Assign) else [child.target]):
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self"):
                    members.add(target.attr)
    bases = [base.id if isinstance(base, ast.Name) else getattr(base, "attr", "?") for base in node.bases]
    return ClassInfo(members, bases)


def module_info(path: str) -> ModuleInfo:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names, classes = set(), {}
    for node in _top_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                classes[node.name] = _class_info(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names.update(_assigned(node))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return ModuleInfo(names, classes)


@functools.cache
def code_index() -> dict[str, ModuleInfo]:
    """Every module of rl_megatron by its dotted name, read from its source (nothing is imported: a module of the
    engines would import vLLM)."""
    index = {}
    for folder, _, files in os.walk(os.path.join(REPO, "rl_megatron")):
        for name in files:
            if name.endswith(".py"):
                relative = os.path.relpath(os.path.join(folder, name), REPO)[:-3].split(os.sep)
                dotted = ".".join(relative[:-1] if relative[-1] == "__init__" else relative)
                index[dotted] = module_info(os.path.join(folder, name))
    return index


def classes_named(name: str) -> list[ClassInfo]:
    return [info.classes[name] for info in code_index().values() if name in info.classes]


def class_has(name: str, member: str, seen=frozenset()) -> bool:
    """Whether a class of rl_megatron named `name` has `member`; True too when a base outside rl_megatron may."""
    for info in classes_named(name):
        if member in info.members:
            return True
        for base in info.bases:
            if base in seen or base == "object":
                continue
            if not classes_named(base) or class_has(base, member, seen | {name}):
                return True  # a base from a library (Exception, TypedDict, torch's Module): it may hold the member
    return False


def resolves(module: str, parts: list[str]) -> bool:
    """Whether `parts` name something in `module`: submodules, then a top-level name, then a class's member."""
    index = code_index()
    if not parts:
        return True
    name, *rest = parts
    if f"{module}.{name}" in index:
        return resolves(f"{module}.{name}", rest)
    info = index[module]
    if name not in info.names:
        return False
    if rest and name in info.classes:
        return class_has(name, rest[0])
    return True  # a function, a variable, or a name one of its imports brings: its attributes are not checked


def module_for_file(path: str) -> str | None:
    """The module of a .py file named by its path from the repository's root or from rl_megatron/."""
    for root in ("", "rl_megatron/"):
        if os.path.isfile(os.path.join(REPO, root + path)):
            dotted = (root + path)[:-3].replace("/", ".")
            return dotted.removesuffix(".__init__")
    return None


FILE_ENDINGS = re.compile(r"\.(py|ya?ml|jsonl?|md|txt|pt|sh|sbatch|parquet|log|safetensors|jinja|toml|cfg|ini)$")


def code_reference(span: str, sections: set[str]) -> tuple[str, list[str], list[list[str]]] | None:
    """What a span of the prose names in rl_megatron's code, if it names something there, by these rules:

    - `rl_megatron.a.b`, `rl_megatron.a.b:name` (a plugin path): the module and the names after it;
    - `a/b.py::Name.member` and `a/b.Name` (a path from the repository's root or from rl_megatron/; `a/b.yaml` and
      other files are paths, not code): the file's module and the names;
    - `Class.member` where a class of rl_megatron has that name: the member;
    - `a.b.c` in lower case where `a` (or `a.b`, ...) ends the dotted name of a module of rl_megatron
      (`spawn.run_distributed` -> rl_megatron.workers.spawn): the names after it, in one of those modules. When `a`
      is also a config section (`rollout.n`), the span is code only where `a.b` already names a module
      (`rollout.vllm_engine.x`), as test_config_keys_named_in_the_prose_exist reads it.
    A call's parentheses are dropped (`Trainer.fit()`, `TrainBatch.from_samples(samples, pad_id)`), and so is a
    decorator's `@`. Anything else (a library's `ray.get`, a config key, a variable) is None: not checked.
    Returns (kind, the names, the candidate modules' dotted names split) or None."""
    span = re.sub(r"\(.*\)$", "", span.strip().lstrip("@"))
    index = code_index()
    if re.fullmatch(r"rl_megatron(\.\w+)+(:\w+(\.\w+)*)?", span):
        parts = span.replace(":", ".").split(".")
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in index:
                return "module path", parts[k:], [parts[:k]]
        return "module path", parts, []
    path = (re.fullmatch(r"([\w/]+\.py)::(\w+(?:\.\w+)*)", span)
            or re.fullmatch(r"(\w+(?:/\w+)+)\.(\w+(?:\.\w+)*)", span))
    if path:
        file, names = path.group(1), path.group(2).split(".")
        if not file.endswith(".py"):
            folder = os.path.dirname(file)
            if FILE_ENDINGS.search(span) or not (os.path.isdir(os.path.join(REPO, "rl_megatron", folder))
                                                 or os.path.isdir(os.path.join(REPO, folder))):
                return None  # a file such as configs/demo_cpu.yaml: test_repository_paths_named_exist
            file += ".py"
        module = module_for_file(file)
        return "file", names, [module.split(".")] if module else []
    if FILE_ENDINGS.search(span):
        return None
    camel = re.fullmatch(r"([A-Z]\w*[a-z]\w*)\.(\w+)", span)
    if camel:
        return ("class", [camel.group(1), camel.group(2)], []) if classes_named(camel.group(1)) else None
    if not re.fullmatch(r"[a-z_]\w*(\.\w+)+", span):
        return None
    parts = span.split(".")
    shortest = 2 if parts[0] in sections else 1
    candidates = []
    for k in range(len(parts) - 1, shortest - 1, -1):
        suffix = "." + ".".join(parts[:k])
        found = [name.split(".") for name in index if ("." + name).endswith(suffix)]
        if found:
            candidates.append((k, found))
    if not candidates:
        return None
    return "module", parts, [(k, found) for k, found in candidates]


def check_code_reference(kind: str, names: list[str], modules: list) -> bool:
    if kind in ("module path", "file"):
        return bool(modules) and resolves(".".join(modules[0]), names)
    if kind == "class":
        return class_has(*names)
    return any(resolves(".".join(module), names[k:]) for k, found in modules for module in found)


def test_code_named_in_the_prose_exists():
    """Every span of the prose that names rl_megatron's code (the rules of `code_reference`) names something that
    exists: a module, a function, a class, a class's method or attribute. Read from the source, not imported."""
    sections = {key for key in schema_keys() if "." not in key}
    checked, missing = 0, []
    for doc, number, span in inline_spans():
        reference = code_reference(span, sections)
        if reference is None:
            continue
        checked += 1
        if not check_code_reference(*reference):
            missing.append(f"{doc}:{number}: `{span}`")
    assert not missing, "names no module, function, class or member of rl_megatron:\n" + "\n".join(missing)
    assert checked >= 100, "the rules found too few names of the code: are they still right?"


# --- figures --------------------------------------------------------------------------------------------------------

BENCHMARKS = "docs/benchmarks.md"
_NUMBER = r"(?<![\w.\-/=+])[~≈]?\d+(?:[.,]\d+)*k?(?:\s?[–-]\s?\d+(?:[.,]\d+)*k?)?"
_SPELLED = r"\b(?:two|three|four|five|six|seven|eight|nine|ten|twenty|thirty|forty|fifty|sixty)"
_TIME = r"(?:ms|s|min|minutes?|seconds?|hours?|h)\b"
# A figure: a number with a unit of time, throughput, memory, a share (%) or a ratio (1.08×, 1.13x); numbers
# spelled out count with a unit of time ("under two minutes").
FIGURE = re.compile(
    rf"{_NUMBER}(?:\s?{_TIME}|-(?:minute|second|hour)\b|\s?%|×(?!\s?\d)|x(?=[\s),.;:]|$)|"
    rf"\s?(?:k?tokens|new tokens|GB|MB|GiB|MiB|[GT]FLOP|steps|samples)/s\b|\s?s/step\b"
    rf"|\s?(?:GiB|MiB|KiB|GB|MB|KB|TB)\b)"
    rf"|{_SPELLED}\s(?:seconds?|minutes?|hours?)\b")

# Units of text (below) with figures that are not measurements, each by a phrase of the unit, with what the figures
# are. Anything measured goes in BENCHMARKS, with its date, machine and command, and the unit links there.
NOT_MEASURED = {
    "docs/algorithms.md": {
        "Their `--dry-run` plans": "the recipes' memory plans, computed by the planner (tests/unit/test_recipes.py)"},
    "docs/architecture.md": {
        "The launch plan counts memory by these phases": "the plan's fixed allowance for CUDA graphs",
        "waits 10 s, not 120": "timeouts of the code"},
    "docs/long-responses.md": {
        "The memory plan (`--dry-run`) counts activations": "the recipes' memory plans, computed by the planner "
                                                            "(tests/unit/test_recipes.py)"},
    "docs/lora.md": {
        "Megatron computes (the 7B recipe's TP=2 engines": "the 7B recipe's planned engine weights, computed",
        "The GSM8K recipe at TP=4 on one node of 80 GB GPUs": "the recipes' memory plans (the table below it; "
                                                               "tests/unit/test_recipes.py) and the device's memory"},
    "docs/model-families.md": {
        "The gpt-oss-20b recipe (8192-token micro-batches": "the pre-flight check's computed scores and the device's "
                                                            "memory (tests/unit/test_sink_attention.py)",
        "Their plans count each sample's Gated DeltaNet state": "the Qwen3.5 and Qwen3-Next recipes' memory plans, "
                                                                "computed by the planner (tests/unit/test_recipes.py)"},
    "docs/moe.md": {
        "**Cost.** The routing is 2 bytes per token": "bytes computed from the model's shape"},
    "docs/multi-node.md": {
        "`RAY_JOIN_TIMEOUT`, 600 s": "the launch script's default timeout",
        "CUDA graphs, 1.5 GiB allowed": "the plan's fixed allowance and the memory it assumes",
        "parameters on H100s (80 GB)": "the recipes' memory plans (the table below it; tests/unit/test_recipes.py), "
                                       "the device's memory",
        "GLM-4.5-Air fits 4 nodes because the plan counts phases": "the recipe's memory plans"},
    "docs/reliability.md": {
        "`ray.connect_timeout_s` (60 s)": "the key's default",
        "else the plan's assumed 80": "the memory the plan assumes"},
    "docs/watching-and-debugging.md": {
        "wait a day instead of 10 to 30 minutes": "timeouts of the code"},
    "docs/gpu.md": {
        "One NVIDIA H100 80GB": "the device's name"},
}


def text_units(doc: str):
    """(first line, text) of each unit of `doc`'s prose: a paragraph, a list item (with its continuation lines), a
    heading, or a table together with its caption (the paragraph right above it, a blank line between). Blank lines
    and fenced blocks end a unit; the text's lines are joined with single spaces."""
    units, previous = [], None  # [first line, last line, lines]
    for number, text in blocks_and_prose(doc)[1]:
        current = units[-1][2] if units and units[-1][1] == previous == number - 1 else None
        last, row = current[-1] if current else "", text.lstrip().startswith("|")
        if text.strip() and (current is None or text.startswith("#") or last.startswith("#")
                             or (re.match(r"^\s*([-*]|\d+\.)\s", text) and not last.lstrip().startswith("|"))
                             or last.lstrip().startswith("|") != row):
            caption = units[-1] if units and row and current is None else None
            if caption and caption[1] == number - 2 and not re.match(r"^(#|\s*([-*|]|\d+\.)\s?)", caption[2][0]):
                caption[1] = number  # a table joins its caption
                caption[2].append(text)
            else:
                units.append([number, number, [text]])
        elif text.strip():
            units[-1][1] = number
            current.append(text)
        previous = number
    return [(first, " ".join(line.strip() for line in lines)) for first, _, lines in units]


def links_to(doc: str, text: str, target: str) -> bool:
    for link in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", text)):
        path = link.partition("#")[0]
        if path and os.path.normpath(os.path.join(os.path.dirname(doc), path)) == target:
            return True
    return False


def figures(text: str) -> list[str]:
    return [match.group(0) for match in FIGURE.finditer(re.sub(r"`[^`]*`", "", text))]


def test_every_figure_outside_the_benchmarks_links_to_them():
    """A measured figure has one home, BENCHMARKS (its date, machine and command); every other document's unit of text
    (`text_units`) with a FIGURE in its prose (code spans and fenced blocks aside) links there, or is one NOT_MEASURED
    names: figures that are no measurement (defaults, timeouts, computed plans, device sizes)."""
    unlinked, found = [], 0
    for doc in DOCS:
        if doc == BENCHMARKS:
            continue
        exempt = NOT_MEASURED.get(doc, {})
        for number, text in text_units(doc):
            named = figures(text)
            found += len(named)
            if named and not links_to(doc, text, BENCHMARKS) and not any(phrase in text for phrase in exempt):
                unlinked.append(f"{doc}:{number}: {', '.join(named)}")
    assert not unlinked, (f"figures in units of text that do not link to {BENCHMARKS} (add the figure there, with "
                          "its date, machine and command, and link it; or list a figure that is no measurement in "
                          "NOT_MEASURED):\n" + "\n".join(unlinked))
    assert found >= 30, "the figure rule found too few: is it still right?"


def test_every_unit_listed_as_not_measured_holds_a_figure():
    for doc, phrases in NOT_MEASURED.items():
        units = [text for _, text in text_units(doc)]
        for phrase in phrases:
            holding = [text for text in units if phrase in text]
            assert holding, f"NOT_MEASURED lists {phrase!r}, which {doc} no longer has: remove it"
            assert all(figures(text) for text in holding), \
                f"{doc}: the unit of {phrase!r} has no figure any more: remove it from NOT_MEASURED"


# --- the architecture page as a map -------------------------------------------------------------------------------

ARCHITECTURE_MAP = ("The floors", "The loop", "What a change must keep", "To add X, touch Y")  # its first screen


def test_the_architecture_page_opens_with_its_map_and_keeps_each_section_to_a_screen():
    """docs/architecture.md: the map's sections first, within 80 lines; every section of the reference after them
    within 60 lines."""
    lines = read("docs/architecture.md").splitlines()
    headings = [(number, text[3:]) for number, text in blocks_and_prose("docs/architecture.md")[1]
                if text.startswith("## ")]
    assert tuple(name for _, name in headings[:len(ARCHITECTURE_MAP)]) == ARCHITECTURE_MAP
    assert headings[len(ARCHITECTURE_MAP)][0] - 1 <= 80, "the map is longer than a screen (80 lines)"
    ends = [number for number, _ in headings[1:]] + [len(lines) + 1]
    for (start, name), end in zip(headings[len(ARCHITECTURE_MAP):], ends[len(ARCHITECTURE_MAP):]):
        assert end - start <= 60, f"docs/architecture.md, {name!r}: {end - start} lines, over a screen (60)"
