"""The gsm8k, MATH and DAPO scorers give verl's scores by default (reward.gsm8k_match / math_match = exact), so that
reward curves compare with verl runs: held here to verl's own code, on thousands of generated cases.

verl is installed at VERL_VERSION by the Makefile (`pip install --no-deps --target .venv/verl-<version>`): without its
dependencies, which would pull a CUDA torch, and in a folder of its own off sys.path (VERL_DIR), because its wheel
also installs top-level `tests` and `scripts` packages that would shadow this repository's tests/. Its scorers,
verl/utils/reward_score/{gsm8k,math_reward,math_dapo}.py, import only `re` and `typing`, but importing them as
`verl.utils.reward_score.X` would first run verl/__init__.py, which needs tensordict and Ray: each is loaded from
its file instead (`verl_scorer`). Which scorer verl gives each data source is read from its `default_compute_score`,
in the source of verl/utils/reward_score/__init__.py (`verl_routes`).

The cases (`gsm8k_cases`, `math_cases`, `dapo_cases`) are drawn with a fixed seed from answers written in many ways
(commas, signs, decimals, \\frac / \\dfrac / \\tfrac, \\sqrt, units, degrees, percent and dollar signs, `x = `,
nested braces, unicode digits), in many formats (`#### 72`, `####72`, `Answer: 72`, no Answer line, one to three
\\boxed{} or \\fbox{}, unclosed or nested boxes, `\\boxed 5$`), with padding across verl's 300- and 100-character
clips, plus huge responses; and the hand-picked cases of ADVERSARIAL. Each case's ground truth is drawn from the
answer's own equivalence group, another group, or the answer as written, so that right, wrong and missing answers
all occur (asserted)."""
import ast
import contextlib
import importlib.metadata
import importlib.util
import io
import os
import random
import sys

import pytest

from rl_megatron.rewards import SCORERS, gsm8k, math, math_dapo, score

VERL_VERSION = "0.9.1"  # the Makefile's VERL; docs/tasks-and-rewards.md names it
VERL_DIR = os.path.join(sys.prefix, f"verl-{VERL_VERSION}")  # the Makefile's VERL_DIR, in the virtual environment
SEED = 0
CASES = 2500  # per scorer
HUGE = 100_000  # characters of the few huge responses
FORMAT_SCORE = 0.1  # tells a wrong answer (format_score) from none (0) where verl's signature has the keyword


def verl_folder() -> str:
    folder = os.path.join(VERL_DIR, "verl", "utils", "reward_score")
    assert os.path.isdir(folder), f"no verl in {VERL_DIR}: `make install` installs verl=={VERL_VERSION} there"
    return folder


def verl_scorer(name: str):
    """verl/utils/reward_score/<name>.py as a module of its own (see the module's docstring for why)."""
    path = os.path.join(verl_folder(), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"verl_reward_score_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def verl():
    return {name: verl_scorer(name) for name in ("gsm8k", "math_reward", "math_dapo")}


def verl_routes() -> tuple[dict[str, set[str]], list[str]]:
    """({data_source: the reward_score modules default_compute_score imports for it}, [the prefixes it routes]),
    read from the source of verl's default_compute_score."""
    with open(os.path.join(verl_folder(), "__init__.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef)
                    and node.name == "default_compute_score")
    routes, prefixes = {}, []
    branch = next(node for node in function.body if isinstance(node, ast.If))
    while isinstance(branch, ast.If):
        modules = {alias.name for statement in branch.body for node in ast.walk(statement)
                   if isinstance(node, ast.ImportFrom) and node.level == 1 for alias in node.names}
        calls = [node for node in ast.walk(branch.test) if isinstance(node, ast.Call)]
        for node in ast.walk(branch.test):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if any(getattr(call.func, "attr", "") == "startswith" and node in call.args for call in calls):
                    prefixes.append(node.value)
                else:
                    routes[node.value] = modules
        branch = branch.orelse[0] if branch.orelse else None
    return routes, prefixes


# --- the cases --------------------------------------------------------------------------------------------------

# Answers in groups that verl may or may not score as equal: a case's ground truth is drawn from its answer's group.
MATH_GROUPS = [
    ["\\frac{1}{2}", "\\frac12", "\\dfrac{1}{2}", "\\tfrac12", "1/2", "0.5", ".5", "0.50", "\\frac{1}2", "\\frac1{2}",
     "\\left(\\frac{1}{2}\\right)", "\\frac {1}{2}", "1 / 2"],
    ["\\frac{3}{4}", "3/4", "\\dfrac34", "0.75", "03/4", "\\frac{3}{4}.", "\\dfrac{3}{4}"],
    ["-\\frac{1}{2}", "-1/2", "\\frac{-1}{2}", "-0.5", "- \\frac12"],
    ["\\sqrt{3}", "\\sqrt3", "\\sqrt 3", "\\sqrt{ 3}", "\\sqrt", "3^{1/2}"],
    ["\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", "\\dfrac{\\sqrt 3}{2}", "\\frac{\\sqrt{3}}2", "\\frac\\sqrt32"],
    ["5", "5.0", "x = 5", "k=5", "x_1 = 5", "5\\text{ cm}", "5 \\text{ dollars}", "5\\text{cm}",
     "5\\text{ cm}\\text{ wide}", "\\$5", "\\$\\,5", "5^\\circ", "5^{\\circ}", "5°", "5\\%", "5%", "\\textbf{5}",
     "\\mbox{5}", "05", " 5 ", "5\n", "\\!5", "\\\\5", "5 cm", "$5$"],
    ["10000", "10,000", "10{,}000", "10\\,000", "10\\!000", "1e4"],
    ["(1,2)", "\\left( 1, 2 \\right)", "(1, 2)", "\\left(1,2\\right)", "[1,2)", "\\left[1,2\\right)"],
    ["\\{1,2\\}", "\\{1, 2\\}", "\\left\\{1,2\\right\\}"],
    ["\\text{(B)}", "(B)", "B", "\\text{B}", "\\textbf{(B)}", "\\text{ (B)}"],
    ["a{b{c}}d", "a{b{c}d", "{a}", "{{a}}", "a}b"],
    ["\\pi", "2\\pi", "\\frac{\\pi}{2}", "\\frac\\pi2", "\\frac{\\pi}2", "\\infty", "-\\infty"],
    ["\\text{Monday}", "Monday", "\\text{ Monday}", "\\mbox{Monday}"],
    ["", " ", "\\frac", "\\frac1", "\\sqrt", "\\leftarrow", "arrow", "=", "x=", "\\text{ }"],
    ["90", "90^\\circ", "90^{\\circ}", "90°", "90 degrees", "90\\text{ degrees}"],
    ["12", "12.", "twelve", "١٢", "１２", "12 \\text{ and } 13", "12,", "12\\text{ and }13"],
    ["48", "48.0", "$48$", "\\$48", "48 dollars", "x = 48", "forty-eight", "48\\text{ apples}", "0048"],
    ["1000", "1,000", "1,000.", "1{,}000", "10^3", "1\\,000"],
]
BOXES = ["\\boxed{%s}", "$\\boxed{%s}$", "\\boxed %s$", "\\boxed %s", "\\fbox{%s}", "\\boxed{%s",
         "\\boxed{\\boxed{%s}}", "\\boxed%s", "\\boxed{%s}}", "{\\boxed{%s}}", "\\[\\boxed{%s}\\]", "\\boxed{{%s}}",
         "\\boxed{%s}$."]
ANSWER_LINES = ["Answer: %s", "ANSWER :\n%s", "answer:%s", "Final Answer: $%s$", "Answer : $\\boxed{%s}$",
                "**Answer:** %s", "The answer is %s", "Answer:%s cm", "Answer: x = %s", "Answer:\t%s.",
                "Answer: %s\nAnswer: 7", "answer: $%s$ dollars"]
PREFIXES = ["", "Let me think. ", "3 + 4 = 7. So ", "Step 1: 12 * 3 = 36\nStep 2: 36 + 12 = 48\n",
            "I got 72, then stopped. ", "We have $x = 3$ and $\\frac{1}{2}$. ", "Answer: 9\n",
            "\\boxed{9} first, then ", "Ünïcödé — ∑ 数学 ", "#### 9\n"]
SUFFIXES = ["", ".", " dollars", "\n", ",", " and 1,234 pears", "}", "$", "\nno, wait\n", " \\boxed{}", "\n\n", "!"]
PAD_LENGTHS = [0, 0, 0, 0, 7, 90, 99, 100, 101, 200, 280, 295, 299, 300, 301, 310, 1000]
PAD_TEXTS = ["x", " ", "\n", "é", "数", "1 ", "{", "}", "$", ". "]


def padding(rng: random.Random) -> str:
    return (rng.choice(PAD_TEXTS) * rng.choice(PAD_LENGTHS))[:1000]


def huge(rng: random.Random) -> str:
    return rng.choice(PAD_TEXTS) * HUGE


def gsm8k_number(rng: random.Random) -> tuple[str, str]:
    """(the number as the response writes it, the dataset's answer)."""
    n = rng.choice([rng.randint(0, 9), rng.randint(10, 999), rng.randint(1000, 10 ** 7)])
    written = rng.choice([str(n)] * 8 + [f"-{n}", f"{n:,}", f"{n}.00", f"{n}.", f".{n}", f"0{n}", f"+{n}",
                          f"--{n}", f"${n}", f"${n:,}", f"{n}.5", "1,2,3", f"{n}%", "٧٢", "７２", f"{n}e3",
                          f"{n}/{rng.randint(1, 9)}", "...", ".", f"{n},", f"{n}.0.0"])
    truth = rng.choice([str(n)] * 4 + [written] * 4 + [f"{n:,}", f"-{n}", f" {n}", str(n + 1), written, "123", "72"])
    return written, truth


def gsm8k_cases(rng: random.Random, count: int):
    markers = ["#### "] * 6 + ["####", "####  ", "##### ", "#### $", "####\t", "The answer is ", "Answer: ", "= ",
               "\\boxed{", "", "#### -"]
    for i in range(count):
        written, truth = gsm8k_number(rng)
        answer = rng.choice(markers) + written + rng.choice(SUFFIXES)
        if rng.random() < 0.2:  # another answer after it
            answer += rng.choice(["\n#### ", " #### ", "\nThen ", " "]) + gsm8k_number(rng)[0]
        pad = huge(rng) if i % 500 == 0 else padding(rng)
        yield (rng.choice(PREFIXES) + pad + answer if rng.random() < 0.8 else answer + pad), truth


def math_answer(rng: random.Random) -> tuple[int, str]:
    group = rng.randrange(len(MATH_GROUPS))
    return group, rng.choice(MATH_GROUPS[group])


def math_truth(rng: random.Random, group: int, written: str) -> str:
    pick = rng.random()
    if pick < 0.5:
        return rng.choice(MATH_GROUPS[group])
    if pick < 0.75:
        return written
    if pick < 0.9:
        return math_answer(rng)[1]
    return rng.choice(["The sum is $\\boxed{%s}$." % written, "\\boxed{%s}" % written, written + " ", "5"])


def boxed_response(rng: random.Random, boxes: int) -> tuple[str, int, str]:
    """A response with `boxes` boxed answers; (text, group, written) of its last one (group -1 when none)."""
    parts, group, written = [rng.choice(PREFIXES)], -1, ""
    for _ in range(boxes):
        group, written = math_answer(rng)
        parts.append(rng.choice(BOXES) % written + rng.choice([" ", ", then ", "\n", "$ and $", ""]))
    return "".join(parts), group, written


def math_cases(rng: random.Random, count: int):
    for i in range(count):
        text, group, written = boxed_response(rng, rng.choice([0, 1, 1, 1, 2, 3]))
        if group < 0:
            group, written = math_answer(rng)
            text += rng.choice(["The answer is ", "Answer: ", "#### ", ""]) + written
        text += rng.choice(SUFFIXES)
        pad = huge(rng) if i % 500 == 0 else padding(rng)
        text = pad + text if rng.random() < 0.8 else text + pad
        yield text, math_truth(rng, group, written)


def dapo_cases(rng: random.Random, count: int):
    for i in range(count):
        parts, group, written = [rng.choice(PREFIXES)], -1, ""
        shape = rng.choice(["line", "line", "box", "box", "both", "box then line", "neither", "two lines"])
        for kind in {"line": ["line"], "box": ["box"], "both": ["line", "box"], "box then line": ["box", "line"],
                     "neither": [], "two lines": ["line", "line"]}[shape]:
            group, written = math_answer(rng)
            if kind == "line":
                parts.append(rng.choice(ANSWER_LINES) % written)
            else:
                parts.append(rng.choice(["The answer is $\\boxed{%s}$.", "\\boxed{%s}", "So \\boxed{%s}",
                                         "\\boxed{\\boxed{%s}}", "\\boxed{%s", "\\fbox{%s}", "\\boxed %s$"])
                             % written)
            parts.append(rng.choice(["\n", " ", "\n\n", padding(rng), ""]))
        if group < 0:
            group, written = math_answer(rng)
            parts.append(written)
        parts.append(rng.choice(SUFFIXES))
        pad = huge(rng) if i % 500 == 0 else padding(rng)
        text = "".join(parts)
        yield (pad + text if rng.random() < 0.8 else text + pad), math_truth(rng, group, written)


# Hand-picked formats, each tried against every scorer with these ground truths beside the generated cases.
ADVERSARIAL = [
    "#### 72", "####72", "####  72", "##### 72", "#### 2718.00", "#### 1239.", "#### .5", "#### 1,000", "#### 1,2,3",
    "#### $1,000", "#### +72", "#### --5", "#### -5", "#### 72 dollars", "#### 5\nno, wait\n#### 6", "#### 3 #### 4",
    "The answer is 72", "", "x" * 1000 + "#### 18", "#### 18\n" + "x" * 400, "a" * 400 + "#### 7" + "b" * 296,
    "#### 5 " * 50_000, "3 + 4 = 7. So 7 apples.", "The answer is 72.", "I got 72, then stopped", "... and that is all",
    ".", "12345" + "z" * 297, "1 " * 100_000 + "2", "\\boxed{5}", "So it is $\\boxed{\\frac{1}{2}}$.",
    "\\boxed{\\dfrac{3}{4}}", "\\boxed{\\left( 1, 2 \\right)}", "\\boxed{10\\text{ cm}}", "\\boxed{90^\\circ}",
    "\\boxed{50\\%}", "\\boxed{x = 5}", "\\boxed{\\sqrt 3}", "\\boxed{a{b{c}}d}", "\\boxed{\\boxed{5}}",
    "First \\boxed{1}, then \\boxed{2}", "\\boxed{5}\\fbox{6}", "\\fbox{7}", "\\boxed 5$ is it", "\\boxed 5\nnext line",
    "\\boxed 1 and later \\boxed{2}", "\\boxed5", "\\boxed{\\frac{1}{2}", "\\boxed{}", "x" * 100_000 + "\\boxed{7}",
    "\\boxed{" + "{" * 100_000, "Answer: 5", "ANSWER :\n7", "The answer is \\boxed{5}", "answer: 1,000",
    "Answer: x = 5", "Answer: $\\frac{1}{2}$", "Answer: 5 cm", "Answer: 5\nAnswer: 6", "Answer: 5" + " " * 400,
    "The answer is $\\boxed{48}$.", "x = 3\nAnswer: $x = 12$ cm", "Answer: [INVALID]\n\\boxed{5}",
    "\\boxed{5}" + " " * 95, "\\boxed{5}" + " " * 100, "Answer: 5" + " " * 280 + "\\boxed{6}",
]
ADVERSARIAL_TRUTHS = ["72", "5", "7", "48", "1000", "1,000", "\\frac{1}{2}", "\\frac12", "12", "2", "", "[INVALID]"]


def all_cases(generate, seed_offset: int):
    rng = random.Random(SEED + seed_offset)
    yield from generate(rng, CASES)
    for response in ADVERSARIAL:
        for truth in ADVERSARIAL_TRUTHS[:3] if len(response) > 10_000 else ADVERSARIAL_TRUTHS:  # huge: a few
            yield response, truth


def quietly(function, *args):
    """verl's MATH scorer prints the exceptions it catches."""
    with contextlib.redirect_stdout(io.StringIO()):
        return function(*args)


def disagreements(cases, ours, theirs) -> tuple[int, list]:
    count, found = 0, []
    for response, truth in cases:
        count += 1
        mine, verls = ours(response, truth), theirs(response, truth)
        if mine != verls:
            found.append((response[:200] + ("..." if len(response) > 200 else ""), truth, mine, verls))
    return count, found


def assert_agree(cases, ours, theirs, minimum: int = CASES):
    count, found = disagreements(cases, ours, theirs)
    assert count >= minimum
    assert not found, f"{len(found)} of {count} cases score otherwise than verl {VERL_VERSION} " \
                      f"(response, ground truth, ours, verl's), the first 10: {found[:10]}"


def outcomes(cases, theirs) -> dict:
    counted = {}
    for response, truth in cases:
        result = theirs(response, truth)
        counted[result] = counted.get(result, 0) + 1
    return counted


# --- the tests ----------------------------------------------------------------------------------------------------

def test_the_installed_verl_is_the_pinned_release():
    verl_folder()
    assert [dist.version for dist in importlib.metadata.distributions(name="verl", path=[VERL_DIR])] == [VERL_VERSION]
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "Makefile"), encoding="utf-8") as f:
        makefile = f.read()
    assert f"\nVERL := {VERL_VERSION}\n" in makefile and "--no-deps --target $(VERL_DIR) verl==$(VERL)" in makefile


def test_verl_routes_these_data_sources_to_these_scorers():
    """The registry follows verl's default_compute_score for the sources of the three scorers held to verl here."""
    routes, prefixes = verl_routes()
    ours = {"gsm8k": {gsm8k.compute_score}, "math_reward": {math.compute_score},
            "math_dapo": {math_dapo.compute_score, math.compute_score_math_source}}
    for source, modules in routes.items():
        for module in modules & set(ours):
            assert modules == {module} and SCORERS.get(source) in ours[module], \
                f"verl scores {source!r} with {modules}"
    assert set().union(*routes.values()) >= set(ours)
    assert prefixes == ["aime"]  # verl's `data_source.startswith("aime")`: docs/tasks-and-rewards.md says how


@pytest.mark.parametrize("method", ["strict", "flexible"])
def test_gsm8k_scores_as_verl(verl, method):
    theirs = verl["gsm8k"].compute_score
    cases = list(all_cases(gsm8k_cases, 1))
    assert_agree(cases, lambda r, t: gsm8k.compute_score(r, t, method=method, format_score=FORMAT_SCORE),
                 lambda r, t: theirs(r, t, method=method, format_score=FORMAT_SCORE))
    if method == "strict":
        assert_agree(cases, lambda r, t: score("openai/gsm8k", r, t), theirs)
    found = outcomes(cases, lambda r, t: theirs(r, t, method=method, format_score=FORMAT_SCORE))
    assert min(found.get(1.0, 0), found.get(FORMAT_SCORE, 0), found.get(0, 0)) > len(cases) // 20, found


def test_math_scores_as_verl(verl):
    theirs = lambda r, t: quietly(verl["math_reward"].compute_score, r, t)  # noqa: E731
    cases = list(all_cases(math_cases, 2))
    assert_agree(cases, math.compute_score, theirs)
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert_agree(cases[::7], lambda r, t: score(source, r, t), theirs, minimum=CASES // 7)
    found = outcomes(cases, theirs)
    assert min(found.get(1.0, 0), found.get(0.0, 0)) > len(cases) // 10, found


def as_verl_dict(result: dict) -> dict:
    """verl's acc is a bool, ours 1.0 / 0.0 (what reward/acc averages)."""
    return {"score": result["score"], "acc": float(result["acc"]), "pred": result["pred"]}


def test_dapo_scores_as_verl(verl):
    theirs = lambda r, t: as_verl_dict(verl["math_dapo"].compute_score(r, t))  # noqa: E731
    cases = list(all_cases(dapo_cases, 3))
    assert_agree(cases, lambda r, t: as_verl_dict(math_dapo.compute_score(r, t)), theirs)
    for source in ("math", "math_dapo", "math_dapo_reasoning"):
        assert_agree(cases[::7], lambda r, t: as_verl_dict(score(source, r, t)), theirs, minimum=CASES // 7)
    found = outcomes(cases, lambda r, t: theirs(r, t)["score"])
    assert min(found.get(1.0, 0), found.get(-1.0, 0)) > len(cases) // 10, found
    fallback = [case for case in cases if "\\boxed{" in case[0] and theirs(*case)["pred"] != "[INVALID]"
                and math_dapo.ANSWER_LINE.search(case[0][-math_dapo.CLIP_CHARS:]) is None]
    assert len(fallback) > len(cases) // 20  # the boxed fallback of verl 0.9.1 is exercised


def test_dapo_without_the_boxed_fallback_scores_as_verl_before_0_9_1(verl):
    """boxed_fallback=False: verl 0.9.0 and earlier, which read the `Answer:` line only."""
    assert math_dapo.compute_score("The answer is $\\boxed{48}$.", "48") == {"score": 1.0, "acc": 1.0, "pred": "48"}
    assert math_dapo.compute_score("The answer is $\\boxed{48}$.", "48", boxed_fallback=False) == {
        "score": -1.0, "acc": 0.0, "pred": "[INVALID]"}
    minerva = verl["math_dapo"].is_correct_minerva  # what verl 0.9.0's verify called alone

    def theirs(response, truth):
        correct, pred = minerva(response[-300:], truth)
        return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": pred}

    assert_agree(list(all_cases(dapo_cases, 3))[::5],
                 lambda r, t: as_verl_dict(math_dapo.compute_score(r, t, boxed_fallback=False)), theirs,
                 minimum=CASES // 5)


@pytest.mark.parametrize("scorer", [gsm8k.compute_score, math.compute_score, math.compute_score_math_source])
def test_an_unknown_match_mode_is_refused(scorer):
    with pytest.raises(ValueError, match="match='loose' is unknown: use one of exact, numeric"):
        scorer("#### 1", "1", match="loose")


def test_numbers_as_ground_truth_compare_as_their_text():
    """verl's parquet files hold text; a number (a user's own file) is compared as its text, where verl would
    score every sample 0 (gsm8k, MATH) or -1 (DAPO)."""
    assert gsm8k.compute_score("#### 72", 72) == 1.0
    assert gsm8k.compute_score("#### 72", 72.0) == 0.0  # "72.0"
    assert math.compute_score("\\boxed{5}", 5) == 1.0
    assert math_dapo.compute_score("Answer: 5", 5)["score"] == 1.0
    assert math_dapo.compute_score("The answer is \\boxed{5}", 5)["score"] == 1.0
    assert math_dapo.compute_score("Answer: 5", None)["score"] == -1.0
    assert math_dapo.compute_score(None, "5") == {"score": -1.0, "acc": 0.0, "pred": "[INVALID]"}
