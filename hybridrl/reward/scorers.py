"""Built-in scorers, chosen by name: `RewardEngine.from_builtin("gsm8k")`.

Each is a plain function `fn(prompts, responses, **columns) -> list[float]`. Data comes in as
columns (`ground_truth`); settings are keyword-only arguments, given as kwargs
(`from_builtin("gsm8k", format_score=0.1)`). A ground truth that cannot be read is a data bug and
raises; a response that cannot be read scores 0.0.
"""

from __future__ import annotations

import difflib
import inspect
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Callable

from hybridrl.reward.math_equiv import is_equiv, last_boxed
from hybridrl.reward.types import RewardError

# A special token at the very end: <|endoftext|>, <|im_end|>, <|eot_id|>, </s>, <eos>, <end_of_turn>.
_TRAILING_SPECIAL = re.compile(r"(?:<\|[^|<>\s]{1,40}\|>|</s>|<eos>|<end_of_turn>)\Z")
_INTEGER = re.compile(r"[+-]?\d+")
DEFAULT_FORMAT_PATTERN = r"^<think>.*?</think>\s*<answer>.*?</answer>$"


def strip_special_tokens(text: str) -> str:
    """`text` without surrounding whitespace and trailing special tokens."""
    text = text.strip()
    while (match := _TRAILING_SPECIAL.search(text)) is not None:
        text = text[: match.start()].rstrip()
    return text


def _int_truth(truth: Any) -> int:
    if isinstance(truth, int) and not isinstance(truth, bool):
        return truth
    if isinstance(truth, str) and _INTEGER.fullmatch(truth.strip()):
        return int(truth.strip())
    raise ValueError(f"ground_truth {truth!r} is not an integer (int or string of digits)")


def arith(prompts: list[str], responses: list[str], ground_truth: list, **columns: Any) -> list[float]:
    """1.0 if the whole response is the integer `ground_truth`, else 0.0."""
    out = []
    for response, truth in zip(responses, ground_truth, strict=True):
        target, text = _int_truth(truth), strip_special_tokens(response)
        out.append(1.0 if _INTEGER.fullmatch(text) and int(text) == target else 0.0)
    return out


def gsm8k_answer(text: str) -> Decimal | None:
    """The number after the last `####`, without commas, `$` or a trailing `.`; None if absent."""
    start = text.rfind("####")
    if start < 0:
        return None
    tail = strip_special_tokens(text[start + 4:]).replace(",", "").replace("$", "").strip()
    match = re.match(r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)", tail)
    return Decimal(match.group(0)) if match else None


def _gsm8k_truth(truth: Any) -> Decimal:
    if isinstance(truth, (int, float)) and not isinstance(truth, bool):
        return Decimal(str(truth))
    if isinstance(truth, str):
        if "####" in truth:  # a full GSM8K solution
            value = gsm8k_answer(truth)
            if value is not None:
                return value
        else:
            try:
                return Decimal(truth.strip().replace(",", "").replace("$", "").rstrip("."))
            except InvalidOperation:
                pass
    raise ValueError(f"ground_truth {truth!r} is neither a number nor a GSM8K solution ending in '#### <number>'")


def gsm8k(
    prompts: list[str], responses: list[str], ground_truth: list, *, format_score: float = 0.0, **columns: Any
) -> list[float]:
    """1.0 if the answer after the last `####` equals the ground truth; `format_score` if there is
    a readable answer that is wrong; 0.0 if there is none."""
    out = []
    for response, truth in zip(responses, ground_truth, strict=True):
        target, answer = _gsm8k_truth(truth), gsm8k_answer(response)
        out.append(0.0 if answer is None else 1.0 if answer == target else float(format_score))
    return out


def math_reward(prompts: list[str], responses: list[str], ground_truth: list, **columns: Any) -> list[float]:
    """1.0 if the last `\\boxed{...}` equals the ground truth (itself boxed or plain) by string,
    number or sympy equivalence (see `math_equiv`), else 0.0."""
    out = []
    for response, truth in zip(responses, ground_truth, strict=True):
        reference = last_boxed(str(truth)) or str(truth)  # a full solution, or the bare answer
        out.append(1.0 if is_equiv(last_boxed(strip_special_tokens(response)), reference) else 0.0)
    return out


def format_reward(
    prompts: list[str], responses: list[str], *, pattern: str = DEFAULT_FORMAT_PATTERN, **columns: Any
) -> list[float]:
    """1.0 if the response (without trailing special tokens) fully matches `pattern` (DOTALL)."""
    regex = re.compile(pattern, re.DOTALL)
    return [1.0 if regex.fullmatch(strip_special_tokens(response)) else 0.0 for response in responses]


def overlong(
    prompts: list[str],
    responses: list[str],
    *,
    max_length: int,
    buffer_length: int,
    response_ids: list[list[int]] | None = None,
    **columns: Any,
) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to `max_length -
    buffer_length`, then linear down to -1 at `max_length`, -1 beyond. Lengths are in tokens when
    `response_ids` are given, else in characters."""
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"overlong needs 0 < buffer_length <= max_length, got {buffer_length} and {max_length}")
    lengths = [len(ids) for ids in response_ids] if response_ids is not None else [len(r) for r in responses]
    free = max_length - buffer_length
    return [0.0 if n <= free else -1.0 if n > max_length else (free - n) / buffer_length for n in lengths]


BUILTIN_SCORERS: dict[str, Callable[..., list[float]]] = {
    "arith": arith,
    "gsm8k": gsm8k,
    "math": math_reward,
    "format": format_reward,
    "overlong": overlong,
}


def get_builtin(name: str, kwargs: dict[str, Any]) -> Callable[..., list[float]]:
    """The scorer registered as `name`, after checking that its required settings are in `kwargs`."""
    if name not in BUILTIN_SCORERS:
        hint = difflib.get_close_matches(name, BUILTIN_SCORERS, n=1)
        raise RewardError(f"unknown built-in scorer {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                          + f"; built-ins: {', '.join(BUILTIN_SCORERS)}")
    fn = BUILTIN_SCORERS[name]
    params = inspect.signature(fn).parameters.values()
    missing = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name not in kwargs]
    if missing:
        example = ", ".join(f"{m}=..." for m in missing)
        raise RewardError(f"built-in scorer {name!r} needs kwargs {missing}, e.g. from_builtin({name!r}, {example}) "
                          "or 'kwargs' in a spec entry")
    return fn
