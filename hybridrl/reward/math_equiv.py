"""Checking a `\\boxed{...}` answer against a reference answer (the MATH dataset's conventions).

Three steps, cheapest first: normalised strings equal (after the clean-ups of Hendrycks et al.
2021, `strip_string`); equal as numbers (integers, decimals, `\\frac{a}{b}`, `a/b`); equal under
sympy. The sympy step only sees text rebuilt from a small whitelist (digits, operators, one-letter
symbols, a few functions), so model output is never evaluated as Python, and it runs on a daemon
thread with a deadline after a guard against huge powers, so no answer can hang the scorer.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

SYMPY_TIMEOUT_S = 2.0
_MAX_SYMPY_CHARS = 200
_FUNCTIONS = {"sqrt", "log", "sin", "cos", "tan", "exp", "pi", "oo"}


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` / `\\fbox{...}` (balanced braces), or `\\boxed 5`."""
    starts = [(text.rfind(cmd), cmd) for cmd in ("\\boxed", "\\fbox")]
    start, cmd = max(starts)
    if start < 0:
        return None
    rest = text[start + len(cmd):]
    if not rest.startswith("{"):
        spaced = re.match(r" +([^\s$]+)", rest)
        return spaced.group(1) if spaced else None
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return rest[1:i]
    return None  # unbalanced


def _group(s: str, i: int) -> tuple[str | None, int]:
    """The LaTeX argument at s[i]: a balanced {...} group, or one character."""
    if i >= len(s):
        return None, i
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1:j], j + 1
    return None, i


def _rewrite_command(s: str, cmd: str, build) -> str | None:
    """Replaces every `cmd{a}{b}` (or `cmd ab`) by `build(a, b)`; None if an argument is missing."""
    num_args = build.__code__.co_argcount
    i = s.find(cmd)
    while i >= 0:
        j, args = i + len(cmd), []
        for _ in range(num_args):
            arg, j = _group(s, j)
            if arg is None:
                return None
            args.append(arg)
        s = s[:i] + build(*args) + s[j:]
        i = s.find(cmd, i + 1)  # from inside the replacement: arguments may hold nested commands
    return s


def normalize(answer: str) -> str:
    """Strips formatting that does not change the answer: `$`, spaces, `\\left`, `\\right`, `\\!`,
    `\\text{...}` (kept: its contents; dropped: trailing units `\\text{ cm}`), degrees, `%`, a
    short `x=` on the left, a trailing `.`; writes `\\dfrac`, `\\frac12`, `\\sqrt2`, `.5` and `a/b`
    the canonical way."""
    s = answer.strip().replace("\n", "")
    s = re.sub(r"\\text\{\s[^{}]*\}$", "", s)  # units, e.g. "5\text{ cm}"
    s = re.sub(r"\\(?:text|textbf|textrm|mathrm|mbox|mathbf)\s*\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = re.sub(r"\\[!,;: ]", "", s)
    for junk in ("\\$", "$", "\\%", "%", " "):
        s = s.replace(junk, "")
    s = s.rstrip(".")
    if (eq := re.fullmatch(r"[A-Za-z]\w?=(.+)", s)) is not None:  # "x=5" -> "5"
        s = eq.group(1)
    s = _rewrite_command(s, "\\frac", lambda a, b: "\\frac{%s}{%s}" % (a, b)) or s  # \frac12
    if "\\sqrt[" not in s:
        s = _rewrite_command(s, "\\sqrt", lambda a: "\\sqrt{%s}" % a) or s  # \sqrt2
    s = re.sub(r"(?<![\d}])\.(\d)", r"0.\1", s)  # ".5" -> "0.5"
    if (slash := re.fullmatch(r"(-?\d+)/(\d+)", s)) is not None:
        s = "\\frac{%s}{%s}" % slash.groups()
    return s


def to_number(s: str) -> Fraction | None:
    """A normalised answer as an exact number, if it is one."""
    sign, body = ("-", s[1:]) if s.startswith("-") else ("", s)
    if (frac := re.fullmatch(r"\\frac\{(-?\d+)\}\{(-?\d+)\}", body)) is not None:
        num, den = int(frac.group(1)), int(frac.group(2))
        return None if den == 0 else Fraction(int(sign + "1") * num, den)
    if re.fullmatch(r"\d{1,3}(,\d{3})+(\.\d+)?", body):  # thousands separators
        body = body.replace(",", "")
    if re.fullmatch(r"\d+\.?\d*|\.\d+", body):
        return Fraction(sign + body)
    return None


def _to_sympy_text(s: str) -> str | None:
    """A whitelisted, sympy-parsable form of a normalised LaTeX answer, or None."""
    if len(s) > _MAX_SYMPY_CHARS:
        return None
    s = _rewrite_command(s, "\\frac", lambda a, b: f"(({a})/({b}))")
    if s is None:
        return None
    s = re.sub(r"\\sqrt\[([^\]]+)\]\{([^{}]*)\}", r"((\2)**(1/(\1)))", s)
    s = _rewrite_command(s, "\\sqrt", lambda a: f"sqrt({a})")
    if s is None:
        return None
    for latex, text in (("\\cdot", "*"), ("\\times", "*"), ("\\infty", "oo"), ("\\ln", "log"), ("^", "**")):
        s = s.replace(latex, text)
    s = re.sub(r"\\(pi|sin|cos|tan|log|exp)(?![A-Za-z])", r"\1", s).replace("{", "(").replace("}", ")")
    if re.search(r"[^0-9A-Za-z+\-*/().\s]", s):  # leftover LaTeX, or anything that is not arithmetic
        return None
    # Every name is a whitelisted function or one-letter symbols: "xy" -> "x*y" (and "eval" -> "e*v*a*l").
    return re.sub(r"[A-Za-z]+", lambda m: m.group(0) if m.group(0) in _FUNCTIONS else "*".join(m.group(0)), s)


def _sympy_equal(a: str, b: str) -> bool:
    import sympy
    from sympy.parsing.sympy_parser import (
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    names = {c: sympy.Symbol(c) for c in "abcdfghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
    names["e"] = sympy.E
    transformations = standard_transformations + (implicit_multiplication_application,)
    exprs = [parse_expr(text, local_dict=names, transformations=transformations, evaluate=False) for text in (a, b)]
    for expr in exprs:  # refuse what would take unbounded time to evaluate, e.g. 10**10**10
        for node in sympy.preorder_traversal(expr):
            if isinstance(node, sympy.Integer) and abs(node) > 10**30:
                return False
            if isinstance(node, sympy.Pow) and node.exp.is_number and abs(float(node.exp)) > 1000:
                return False
    return sympy.simplify(exprs[0] - exprs[1]) == 0


def sympy_equal(a: str, b: str, timeout_s: float = SYMPY_TIMEOUT_S) -> bool:
    """True if sympy proves the normalised answers equal within `timeout_s`; False otherwise."""
    try:
        import sympy  # noqa: F401  (a dependency of torch, but not of this package)
    except ImportError:
        return False
    texts = (_to_sympy_text(a), _to_sympy_text(b))
    if None in texts:
        return False
    verdict: list[bool] = []

    def check() -> None:
        try:
            verdict.append(_sympy_equal(*texts))
        except Exception:  # answers are arbitrary model text: what sympy cannot handle is not proven equal
            verdict.append(False)

    worker = threading.Thread(target=check, name="hybridrl-sympy", daemon=True)  # abandoned if it overruns
    worker.start()
    worker.join(timeout_s)
    return bool(verdict and verdict[0])


def _split_top_level(s: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in s:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return parts + [current]


def is_equiv(answer: str | None, reference: str) -> bool:
    """Whether `answer` (a boxed answer) equals `reference` by string, number, or sympy."""
    if answer is None:
        return False
    a, b = normalize(answer), normalize(reference)
    if a == b:
        return True
    num_a, num_b = to_number(a), to_number(b)
    if num_a is not None and num_b is not None:
        return abs(num_a - num_b) <= Fraction(1, 10**8) * max(1, abs(num_b))
    parts_a, parts_b = _split_top_level(a.strip("()[]")), _split_top_level(b.strip("()[]"))
    if len(parts_a) > 1 or len(parts_b) > 1:  # tuples / lists: element by element, in order
        return len(parts_a) == len(parts_b) and all(map(is_equiv, parts_a, parts_b))
    return sympy_equal(a, b)
