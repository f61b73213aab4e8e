"""The doctor's results: one line per check, the measured figure, and the fix when it failed."""
from __future__ import annotations

import traceback
from dataclasses import asdict, dataclass
from typing import Callable

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    figure: str  # what was measured (or, for SKIP, why it does not apply)
    fix: str = ""  # what to do, when it failed

    def as_dict(self) -> dict:
        return asdict(self)


def guarded(name: str, check: Callable[[], Result | list[Result]]) -> list[Result]:
    """A check's results; a check that crashes (a process group that never forms, an engine that fails to start)
    is a FAIL naming the error, and the checks after it still run."""
    try:
        results = check()
    except Exception as err:  # the doctor reports every failure, its traceback above (or in the workers' logs)
        traceback.print_exc()
        last = str(err).strip().splitlines()[-1] if str(err).strip() else ""
        return [Result(name, FAIL, f"{type(err).__name__}: {last}", "see the error above; the checks that passed "
                       "narrow down where it comes from")]
    return results if isinstance(results, list) else [results]


def table(results: list[Result]) -> str:
    width = max(len(r.name) for r in results)
    lines = []
    for r in results:
        lines.append(f"{r.status:4}  {r.name:{width}}  {r.figure}")
        if r.fix:
            lines.append(f"{'':4}  {'':{width}}  fix: {r.fix}")
    return "\n".join(lines)


def exit_code(results: list[Result]) -> int:
    """0 when every applicable check passed."""
    return 1 if any(r.status == FAIL for r in results) else 0


def gb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9
