"""Input files of `capserve capture`: streamed line by line, never loaded whole.

JSONL: one JSON object per line with exactly one prompt key — `text` (a string),
`prompt_token_ids` (a list of ints) or `messages` (chat messages, `[{"role", "content"}]`,
rendered with the model's chat template on the replica). An `id` key, when present, is copied
into the index; other keys are ignored, so dataset rows can be fed as they are.
Plain text: every line is one prompt (without its line break).

Blank lines are skipped in both formats but still counted: line numbers always match the file,
so the index's `line` (0-based) points back to the source line, and shard k always covers the
same lines on every run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Prompt = str | list[int] | list[dict[str, str]]
InputFormat = Literal["jsonl", "text"]
PROMPT_KEYS = ("text", "prompt_token_ids", "messages")
_JSONL_SUFFIXES = {".jsonl", ".ndjson", ".json"}
_FINGERPRINT_BYTES = 1 << 20


class InputError(ValueError):
    """A malformed input line; the message names the file and the line (1-based, like an editor)."""


@dataclass(frozen=True)
class InputLine:
    line: int  # 0-based line number in the file
    prompt: Prompt | None  # None: a blank line (no request, no rows)
    id: Any = None


def detect_format(path: Path) -> InputFormat:
    """By suffix (.jsonl/.ndjson/.json, .txt), else by the first non-blank line."""
    if path.suffix.lower() in _JSONL_SUFFIXES:
        return "jsonl"
    if path.suffix.lower() == ".txt":
        return "text"
    with open(path, "rb") as f:
        for raw in f:
            text = raw.strip()
            if text:
                try:
                    return "jsonl" if isinstance(json.loads(text), dict) else "text"
                except (ValueError, UnicodeDecodeError):
                    return "text"
    return "text"


def read_input(path: Path, fmt: InputFormat, skip: Callable[[int], bool] = lambda line: False) -> Iterator[InputLine]:
    """Every line of the file in order; lines where `skip(line)` (those of finished shards on a
    rerun) are yielded as blank without being decoded or parsed."""
    # Binary lines split on b"\n" only, so numbering agrees with `count_lines` and with `wc -l`
    # (text mode would also split on a stray "\r" inside a line).
    with open(path, "rb") as f:
        for number, raw in enumerate(f):
            if skip(number):
                yield InputLine(number, None)
                continue
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                raise InputError(f"{path}:{number + 1}: not UTF-8 ({exc})") from None
            if not text.strip():
                yield InputLine(number, None)
            elif fmt == "text":
                yield InputLine(number, text)
            else:
                yield parse_jsonl_line(path, number, text)


def parse_jsonl_line(path: Path, number: int, text: str) -> InputLine:
    where = f"{path}:{number + 1}"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc}); use --format text for plain-text prompts") from None
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object with one of {', '.join(PROMPT_KEYS)}, got {type(record).__name__}")
    keys = [k for k in PROMPT_KEYS if k in record]
    if len(keys) != 1:
        found = ", ".join(keys) or f"none (keys: {', '.join(record) or 'none'})"
        raise InputError(f"{where}: needs exactly one prompt key of {', '.join(PROMPT_KEYS)}; found {found}")
    prompt = record[keys[0]]
    if not _prompt_ok(keys[0], prompt):
        expected = {"text": "a string", "prompt_token_ids": "a list of ints", "messages": "a list of {role, content} objects"}
        raise InputError(f"{where}: {keys[0]} must be non-empty {expected[keys[0]]}")
    return InputLine(number, prompt, record.get("id"))


def _prompt_ok(key: str, prompt: Any) -> bool:
    if key == "text":
        return isinstance(prompt, str) and bool(prompt)
    if not isinstance(prompt, list) or not prompt:
        return False
    if key == "prompt_token_ids":
        return all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    return all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt)


def count_lines(path: Path) -> int:
    """Lines as `read_input` numbers them (a last line without a line break counts), in 1 MiB
    chunks so memory stays flat."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def fingerprint(path: Path) -> dict[str, Any]:
    """Size and a hash of the first MiB: a rerun against a changed input fails instead of
    mixing shards of two inputs (hashing the whole file would cost a full read per rerun)."""
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(_FINGERPRINT_BYTES)).hexdigest()
    return {"path": str(path.resolve()), "size": path.stat().st_size, "sha256_first_mib": head}
