"""The built-in demo task: single-digit addition with a single-digit answer, e.g. "3+4=" -> "7"."""


def arithmetic_rows() -> list[dict]:
    return [
        {"prompt": f"{a}+{b}=", "ground_truth": str(a + b), "data_source": "arithmetic"}
        for a in range(10)
        for b in range(10 - a)
    ]
