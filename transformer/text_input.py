"""Reading the text a CLI is given (stdin or a file), one sentence a line."""

from __future__ import annotations


def read_lines(data: bytes, name: str) -> list[str]:
    """The UTF-8 lines of `data` (empty input: no lines). A line that is not UTF-8 or holds a
    NUL byte (binary input) raises ValueError naming `name` (a file, or stdin) and the line."""
    lines = []
    for number, raw in enumerate(data.splitlines(), 1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{name} line {number} is not UTF-8 ({error.reason} at byte "
                             f"{error.start}): give UTF-8 text") from None
        if "\x00" in lines[-1]:
            raise ValueError(f"{name} line {number} holds a NUL byte: binary input? give UTF-8 "
                             f"text, one sentence a line")
    return lines
