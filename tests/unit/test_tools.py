"""rl_megatron.tools: parsing Hermes tool calls, the tool config file, ToolSet.call's error outcomes, the calculator
and the sandboxed Python tool (whose tests start real subprocesses, each well under a second but the timeouts')."""
import asyncio
import json
import math
import os
import time

import pytest
from helpers.runs import REPO

from rl_megatron.errors import ConfigError
from rl_megatron.tools import Tool, ToolCall, ToolOutcome, ToolSet, parse_tool_calls
from rl_megatron.tools.calculator import CalculatorTool
from rl_megatron.tools import sandbox
from rl_megatron.tools.python_tool import PythonTool

KEY = "rollout.multi_turn.tool_config_path"
EXAMPLE_CONFIG = os.path.join(REPO, "configs", "tools", "python_calculator.yaml")


def _schema(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name, "description": f"the {name} tool"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


CALCULATOR_SCHEMA = _schema("calculator", {"type": "object", "properties": {"expression": {"type": "string"}},
                                           "required": ["expression"]})
PYTHON_SCHEMA = _schema("python", {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]})


# ---------------------------------------------------------------------------------------------------- parse_tool_calls

def test_parse_single_call():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCall("calculator", {"expression": "2+3"})]
    assert parsed.errors == []


def test_parse_several_calls_in_order_with_optional_whitespace():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>  \n {"name": "b", "arguments": {"y": [2]}}\n\n</tool_call> done')
    assert parse_tool_calls(text).calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [2]})]


def test_parse_arguments_given_as_a_json_string():
    text = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    assert parse_tool_calls(text).calls == [ToolCall("python", {"code": "print(1)"})]


@pytest.mark.parametrize("arguments", ["", ', "arguments": null', ', "arguments": ""'])
def test_parse_missing_arguments_are_empty(arguments):
    parsed = parse_tool_calls(f'<tool_call>{{"name": "now"{arguments}}}</tool_call>')
    assert parsed.calls == [ToolCall("now", {})] and parsed.errors == []


@pytest.mark.parametrize("body, expected", [
    ('{"name": "a", "arguments": {"x": 1}', "not valid JSON"),
    ('{"arguments": {"x": 1}}', '"name"'),
    ('{"name": "", "arguments": {}}', '"name"'),
    ('{"name": 3}', '"name"'),
    ('["a", {}]', "array, not an object"),
    ('{"name": "a", "arguments": [1, 2]}', '"arguments" is a JSON array'),
    ('{"name": "a", "arguments": "{not json"}', '"arguments" is not valid JSON'),
    ('{"name": "a", "arguments": "[1]"}', '"arguments" is a JSON array'),
])
def test_parse_malformed_blocks_are_errors_and_the_good_ones_still_parse(body, expected):
    text = f'<tool_call>{body}</tool_call>\n<tool_call>{{"name": "ok", "arguments": {{}}}}</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCall("ok", {})]
    assert len(parsed.errors) == 1
    assert parsed.errors[0].startswith("Error: tool call #1 is malformed") and expected in parsed.errors[0]


def test_parse_unclosed_block_is_an_error():
    parsed = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "argu')
    assert parsed.calls == [ToolCall("a", {})]
    assert len(parsed.errors) == 1 and "#2 has no closing </tool_call>" in parsed.errors[0]


@pytest.mark.parametrize("text", ["", "The answer is 5.", "I will not call </tool_call> anything", "<tool_call"])
def test_parse_text_without_calls(text):
    assert parse_tool_calls(text).calls == [] and parse_tool_calls(text).errors == []


# ---------------------------------------------------------------------------------------------------------- calculator

def _calculate(expression: str) -> ToolOutcome:
    return asyncio.run(CalculatorTool({}, CALCULATOR_SCHEMA).execute({"expression": expression}, {}))


@pytest.mark.parametrize("expression, expected", [
    ("2+3", "5"),
    ("2 + 3 * 4", "14"),  # precedence
    ("(2 + 3) * 4", "20"),
    ("-2 ** 2", "-4"),  # ** binds tighter than unary minus
    ("(-2) ** 2", "4"),
    ("-(3 - 10)", "7"),
    ("+5 - -5", "10"),
    ("2 ** 3 ** 2", "512"),  # right-associative
    ("7 / 2", "3.5"),  # true division
    ("14 / 2", "7"),  # an integral float prints as an int
    ("2 / 3", "0.6666666666666666"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("7 % 3", "1"),
    ("-7 % 3", "2"),
    ("2 ** -2", "0.25"),
    ("0.1 + 0.2", "0.30000000000000004"),
    ("1.5e3 * 2", "3000"),
    ("123456789 * 987654321", "121932631112635269"),
    ("10 ** 20", "100000000000000000000"),
    ("1e20", "1e+20"),  # a float that large keeps its float form
])
def test_calculator_values(expression, expected):
    assert _calculate(expression) == ToolOutcome(text=expected)


@pytest.mark.parametrize("expression, expected", [
    ("x + 1", "not arithmetic"),
    ("abs(-3)", "not arithmetic"),
    ("__import__('os').system('ls')", "not arithmetic"),
    ("(1).real", "not arithmetic"),
    ("'a' * 3", "is not a number"),
    ("True + 1", "is not a number"),
    ("2j", "is not a number"),
    ("1 < 2", "not arithmetic"),
    ("3 ^ 2", "write ** for a power"),
    ("9**9**9", "exponent"),
    ("2**10000000", "exponent"),
    ("10 ** 5000", "digits"),
    ("(10 ** 3000) * (10 ** 3000)", "digits"),
    ("1 +" * 400 + "1", "characters long"),
    ("1 / 0", "division by zero"),
    ("5 // 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("1e308 * 10", "too large"),
    ("10.0 ** 400", "too large"),
    ("(-8) ** 0.5", "complex"),
    ("1 +", "not a valid expression"),
    ("", "not a valid expression"),
])
def test_calculator_errors_are_fast_error_outcomes(expression, expected):
    start = time.perf_counter()
    outcome = _calculate(expression)
    assert time.perf_counter() - start < 0.1
    assert outcome.error and not outcome.timed_out
    assert outcome.text.startswith("Error: ") and expected in outcome.text


# --------------------------------------------------------------------------------------------------------- python tool

# The kernel boundary where this machine can set it up (tests/unit/test_sandbox.py tests it), else none: what these
# tests check holds either way.
ISOLATION = "namespaces" if sandbox.available() else "none"


@pytest.fixture(scope="module")
def python_tool():
    return PythonTool({"timeout_s": 5, "isolation": ISOLATION}, PYTHON_SCHEMA)


def _run(tool: PythonTool, code: str) -> ToolOutcome:
    return asyncio.run(tool.execute({"code": code}, {}))


def test_python_prints_output(python_tool):
    assert _run(python_tool, "print(6 * 7)\nprint('done')") == ToolOutcome(text="42\ndone\n")
    assert _run(python_tool, "x = 1") == ToolOutcome(text="(no output)")


def test_python_exception_is_an_error_with_its_traceback(python_tool):
    outcome = _run(python_tool, "print('before')\ndef f():\n    return 1 / 0\nf()")
    assert outcome.error and not outcome.timed_out
    assert outcome.text.startswith("before\nTraceback (most recent call last):")
    assert 'File "<code>", line 3, in f' in outcome.text and "return 1 / 0" in outcome.text
    assert outcome.text.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in outcome.text  # the launcher's frames are hidden


def test_python_nonzero_exit_without_output_is_an_error(python_tool):
    assert _run(python_tool, "import sys\nsys.exit(3)") == ToolOutcome(text="Error: exit code 3.", error=True)


def test_python_infinite_loop_times_out(python_tool):
    """The wall limit kills the loop, keeping what it printed. The limit (1 s on an idle machine) and the bound on
    the kill are set from what a trivial call costs here and now, measured first: on a loaded machine, starting the
    program alone may take longer than 1 s, and the kill's bound must not depend on the load."""
    start = time.perf_counter()
    assert _run(python_tool, "print(1)").text == "1\n"
    call = time.perf_counter() - start
    limit = max(1, math.ceil(5 * call))
    tool = PythonTool({"timeout_s": limit, "isolation": ISOLATION}, PYTHON_SCHEMA)
    start = time.perf_counter()
    outcome = _run(tool, "print('started', flush=True)\nwhile True:\n    pass")
    assert time.perf_counter() - start < limit + 3 * max(call, 1)  # killed at the limit, not left running
    assert outcome.error and outcome.timed_out
    assert outcome.text.startswith("started\n") and f"limit of {limit} s of wall time" in outcome.text


def test_python_cpu_time_limit_kills_before_the_wall_clock():
    tool = PythonTool({"timeout_s": 20, "cpu_time_s": 1, "isolation": ISOLATION}, PYTHON_SCHEMA)
    outcome = _run(tool, "while True:\n    pass")
    assert outcome.error and outcome.timed_out and "1 s of CPU time" in outcome.text


def test_python_memory_bomb_is_an_error(python_tool):
    outcome = _run(python_tool, "data = bytearray(4 * 1024 ** 3)\nprint(len(data))")
    assert outcome.error and not outcome.timed_out and "MemoryError" in outcome.text


def test_python_network_is_blocked(python_tool):
    outcome = _run(python_tool, "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert outcome.error and "network access is blocked" in outcome.text
    outcome = _run(python_tool, "import socket\nsocket.socket().connect(('127.0.0.1', 22))")
    assert outcome.error and "network access is blocked in this sandbox (socket.connect)" in outcome.text


@pytest.mark.skipif(ISOLATION == "none", reason="unprivileged user namespaces are off on this machine")
def test_python_runs_in_an_empty_network_namespace(python_tool):
    outcome = _run(python_tool, "import socket\nprint([name for _, name in socket.if_nameindex()])")
    assert outcome == ToolOutcome(text="['lo']\n")


@pytest.mark.parametrize("code, event", [
    ("import subprocess\nsubprocess.run(['ls'])", "subprocess.Popen"),
    ("import os\nos.system('ls')", "os.system"),
    ("import os\nos.execv('/bin/ls', ['ls'])", "os.exec"),
    ("import os\nos.fork()", "os.fork"),
    ("import _posixsubprocess\n_posixsubprocess.fork_exec()", "creating processes is blocked"),
    ("import os, signal\nos.kill(os.getppid(), signal.SIGTERM)", "os.kill"),
    ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "resource.setrlimit"),
    ("import ctypes\nctypes.CDLL(None).getpid()", "ctypes.dlsym"),
])
def test_python_process_creation_signals_limits_and_native_calls_are_blocked(python_tool, code, event):
    outcome = _run(python_tool, code)
    assert outcome.error and "PermissionError" in outcome.text and event in outcome.text


def test_python_common_libraries_still_work(python_tool):
    code = ("import asyncio, collections, fractions, json, math, threading\n"
            "print(math.comb(10, 3), fractions.Fraction(1, 3) * 3, collections.Counter('aab')['a'])")
    assert _run(python_tool, code) == ToolOutcome(text="120 1 2\n")


def test_python_runs_in_a_fresh_directory_that_is_removed_with_a_minimal_environment(python_tool, monkeypatch):
    monkeypatch.setenv("RL_MEGATRON_TEST_SECRET", "s3cret")
    code = ("import json, os\nopen('notes.txt', 'w').write('x')\n"
            "print(json.dumps({'cwd': os.getcwd(), 'files': os.listdir('.'), 'env': dict(os.environ)}))")
    first, second = (json.loads(_run(python_tool, code).text) for _ in range(2))
    assert first["files"] == ["notes.txt"] and second["files"] == ["notes.txt"]
    if ISOLATION == "none":  # a temporary folder of the machine's; isolated: /work in the call's own root
        assert first["cwd"] != second["cwd"] and not os.path.exists(first["cwd"])
    else:
        assert first["cwd"] == second["cwd"] == "/work"
    assert "RL_MEGATRON_TEST_SECRET" not in first["env"] and first["env"]["HOME"] == first["cwd"]
    assert set(first["env"]) == {"PATH", "LANG", "HOME", "TMPDIR"}


def test_python_code_comes_over_stdin_and_is_in_no_file(python_tool):
    """No file holds the code (a concurrent call could rewrite it before it is read): it comes over stdin, read to
    its end before it runs, also past a pipe's buffer; the code's own stdin is then empty."""
    marker = "x" * 200_000  # more than a pipe holds: the launcher reads while it is written
    code = (f"import os, sys\nmarker = {marker!r}\nprint(len(marker), repr(sys.stdin.read()))\n"
            "print(os.listdir('.'), all(arg.isdigit() for arg in sys.argv[1:]))")  # the limits are its only arguments
    assert _run(python_tool, code).text == "200000 ''\n[] True\n"


def test_python_output_flood_is_capped(python_tool):
    outcome = _run(python_tool, "print('x' * 10_000_000)")
    assert not outcome.error
    assert outcome.text.startswith("x" * 65536 + "\n[... 9934465 more bytes of stdout dropped]")
    assert len(outcome.text) < 70_000


def test_python_tool_rejects_bad_config():
    with pytest.raises(ValueError, match="unknown key.*timeout"):
        PythonTool({"timeout": 3}, PYTHON_SCHEMA)
    with pytest.raises(ValueError, match="memory_mb=-1 must be a positive number"):
        PythonTool({"memory_mb": -1}, PYTHON_SCHEMA)
    with pytest.raises(ValueError, match="isolation=False must be one of namespaces, none"):
        PythonTool({"isolation": False}, PYTHON_SCHEMA)  # YAML's unquoted `off`


# ------------------------------------------------------------------------------------------------------------- ToolSet

class EchoStateTool(Tool):
    async def execute(self, arguments: dict, state: dict) -> ToolOutcome:
        return ToolOutcome(text=json.dumps(state, sort_keys=True))


class RaisingTool(Tool):
    async def execute(self, arguments: dict, state: dict) -> ToolOutcome:
        raise ValueError("boom")


class SleepingTool(Tool):
    async def execute(self, arguments: dict, state: dict) -> ToolOutcome:
        await asyncio.sleep(10)
        return ToolOutcome(text="woke up")


def _call(tools: ToolSet, name: str, arguments: dict, tools_kwargs: dict | None = None,
          timeout_s: float = 5.0) -> ToolOutcome:
    return asyncio.run(tools.call(ToolCall(name, arguments), tools_kwargs, timeout_s))


def test_toolset_from_the_example_config_runs_both_builtins():
    tools = ToolSet.from_config_file(EXAMPLE_CONFIG)
    assert tools.names() == ["calculator", "python"]
    assert [schema["function"]["name"] for schema in tools.schemas()] == ["calculator", "python"]
    assert _call(tools, "calculator", {"expression": "6*7"}) == ToolOutcome(text="42")
    assert _call(tools, "python", {"code": "print(6*7)"}) == ToolOutcome(text="42\n")


def test_toolset_from_a_written_config_file(tmp_path):
    config = {"tools": [
        {"class_name": "rl_megatron.tools.calculator:CalculatorTool", "tool_schema": CALCULATOR_SCHEMA},
        {"class_name": "rl_megatron.tools.python_tool.PythonTool", "config": {"timeout_s": 3},
         "tool_schema": PYTHON_SCHEMA},
    ]}
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(config))
    tools = ToolSet.from_config_file(str(path))
    assert tools.names() == ["calculator", "python"] and tools.schemas() == [CALCULATOR_SCHEMA, PYTHON_SCHEMA]
    assert _call(tools, "calculator", {"expression": "1/4"}) == ToolOutcome(text="0.25")


def test_toolset_unknown_tool_names_the_known_ones():
    tools = ToolSet([CalculatorTool({}, CALCULATOR_SCHEMA), PythonTool({"isolation": ISOLATION}, PYTHON_SCHEMA)])
    outcome = _call(tools, "foo", {})
    assert outcome == ToolOutcome(text="Error: unknown tool 'foo'; available: calculator, python", error=True)


@pytest.mark.parametrize("arguments, expected", [
    ({}, "'expression' is a required property"),
    ({"expression": 3}, "at ['expression']: 3 is not of type 'string'"),
])
def test_toolset_validates_arguments_against_the_schema(arguments, expected):
    outcome = _call(ToolSet([CalculatorTool({}, CALCULATOR_SCHEMA)]), "calculator", arguments)
    assert outcome.error and not outcome.timed_out
    assert outcome.text.startswith("Error: invalid arguments for calculator") and expected in outcome.text


def test_toolset_turns_an_exception_into_an_error_outcome():
    outcome = _call(ToolSet([RaisingTool({}, _schema("raiser"))]), "raiser", {})
    assert outcome == ToolOutcome(text="Error: ValueError: boom", error=True)


class CountingTool(Tool):
    """Sleeps 0.2 s per call, counting the calls running at once."""
    rate_limit = 2
    running = peak = 0

    async def execute(self, arguments: dict, state: dict) -> ToolOutcome:
        CountingTool.running += 1
        CountingTool.peak = max(CountingTool.peak, CountingTool.running)
        await asyncio.sleep(0.2)
        CountingTool.running -= 1
        return ToolOutcome(text="done")


def test_a_tools_rate_limit_caps_its_calls_at_once_and_the_wait_is_not_timed():
    """6 calls of 0.2 s at rate_limit 2: 2 at a time, in three waves; a call's 0.3 s time limit starts when it runs
    (the last wave waited 0.4 s first), and each outcome says how long it waited. Batches run in event loops of their
    own (asyncio.run per rollout): the slots follow."""
    tools = ToolSet([CountingTool({}, _schema("counting"))])

    async def batch():
        return await asyncio.gather(*(tools.call(ToolCall("counting", {}), None, 0.3) for _ in range(6)))

    for _ in range(2):
        CountingTool.peak = 0
        outcomes = asyncio.run(batch())
        assert CountingTool.peak == 2 and all(outcome.text == "done" and not outcome.error for outcome in outcomes)
        waits = sorted(outcome.slot_wait_s for outcome in outcomes)
        assert waits[:2] == pytest.approx([0, 0], abs=0.05)
        assert waits[2:4] == pytest.approx([0.2, 0.2], abs=0.1) and waits[4:] == pytest.approx([0.4, 0.4], abs=0.1)
    assert PythonTool({"isolation": ISOLATION}, PYTHON_SCHEMA).rate_limit == os.cpu_count()
    assert PythonTool({"isolation": ISOLATION, "rate_limit": 3}, PYTHON_SCHEMA).rate_limit == 3


def test_toolset_enforces_the_timeout():
    start = time.perf_counter()
    outcome = _call(ToolSet([SleepingTool({}, _schema("sleeper"))]), "sleeper", {}, timeout_s=0.2)
    assert time.perf_counter() - start < 2
    assert outcome == ToolOutcome(text="Error: sleeper timed out after 0.2 s", error=True, timed_out=True)


def test_toolset_timeout_kills_a_running_python_tool():
    tools = ToolSet([PythonTool({"timeout_s": 30, "isolation": ISOLATION}, PYTHON_SCHEMA)])
    start = time.perf_counter()
    outcome = _call(tools, "python", {"code": "import time\ntime.sleep(30)"}, timeout_s=0.5)
    assert time.perf_counter() - start < 3 and outcome.timed_out


def test_toolset_passes_the_rows_tools_kwargs_as_state():
    tools = ToolSet([EchoStateTool({}, _schema("echo"))])
    tools_kwargs = {"echo": {"create_kwargs": {"ground_truth": "7"}}, "other": {"x": 1}}
    assert _call(tools, "echo", {}, tools_kwargs).text == '{"create_kwargs": {"ground_truth": "7"}}'
    assert _call(tools, "echo", {}, {"other": {"x": 1}}).text == "{}"
    assert _call(tools, "echo", {}, None).text == "{}"


# ------------------------------------------------------------------------------------------------------- config errors

def _entry(name: str = "calculator", **overrides) -> dict:
    entry = {"class_name": "rl_megatron.tools.calculator.CalculatorTool", "tool_schema": _schema(
        name, {"type": "object", "properties": {"expression": {"type": "string"}}})}
    entry.update(overrides)
    return entry


@pytest.mark.parametrize("second, expected", [
    ("not a mapping", "tools[1] is a str"),
    (_entry(class_name=None), "tools[1].class_name is missing"),
    (_entry(class_name="no_such_package.tools.Tool"), "module 'no_such_package' was not found"),
    (_entry(class_name="rl_megatron.tools.calculator.NoSuchTool"), "'NoSuchTool' in 'rl_megatron.tools.calculator' is "
                                                                   "nothing, not a subclass of"),
    (_entry(class_name="rl_megatron.errors:ConfigError"), "is a type, not a subclass of rl_megatron.tools.base.Tool"),
    (_entry(class_name="rl_megatron.errors.one_line"), "is a function, not a subclass"),
    (_entry(class_name="CalculatorTool"), "must be 'package.module.Class'"),
    (_entry(config=[1]), "tools[1].config is a list"),
    (_entry(tool_schema=None), "tools[1].tool_schema must be an OpenAI function schema"),
    (_entry(tool_schema={"type": "object", "function": {"name": "x"}}), "must be an OpenAI function schema"),
    (_entry(tool_schema={"type": "function", "function": {"description": "x"}}), "tools[1].tool_schema.function.name"),
    (_entry(tool_schema=_schema("x", {"type": "objekt"})), "tools[1].tool_schema.function.parameters is not a valid "
                                                          "JSON Schema at type: 'objekt' is not valid"),
    (_entry(tool_schema=_schema("x", "a string")), "parameters is a str"),
    (_entry(class_name="rl_megatron.tools.python_tool.PythonTool", config={"timeout": 1}),
     "tools[1]: building PythonTool failed: ValueError: unknown key(s) timeout"),
    (_entry("calculator"), "tools[1] is named 'calculator' like tools[0]"),
])
def test_config_errors_name_the_key_and_the_entry(tmp_path, second, expected):
    path = tmp_path / "tools.yaml"
    path.write_text(json.dumps({"tools": [_entry("calculator"), second]}))
    with pytest.raises(ConfigError) as raised:
        ToolSet.from_config_file(str(path))
    message = str(raised.value)
    assert message.startswith(f"{KEY}={path}") and "tools[1]" in message and expected in message


@pytest.mark.parametrize("content, expected", [
    (None, "file not found"),
    ("tools: [unclosed", "not valid YAML or JSON"),
    ("other: 1", "needs a non-empty `tools:` list"),
    ("tools: []", "needs a non-empty `tools:` list"),
    ("- just a list", "needs a non-empty `tools:` list"),
])
def test_config_errors_for_the_file(tmp_path, content, expected):
    path = tmp_path / "tools.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as raised:
        ToolSet.from_config_file(str(path), key="agent.tools")
    assert str(raised.value).startswith(f"agent.tools={path}: ") and expected in str(raised.value)
