"""The text a CLI reads and writes (translate, generate): one sentence or prompt a line, from
stdin or a file, to stdout or a file, in order; bad input or output ends the program with one
line `error: ...` on stderr."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

# What read_lines splits bytes on: a line break inside an output text becomes a space, so
# output line i always answers input line i.
_LINE_BREAKS = ("\r\n", "\r", "\n")


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


def read_input(path: str | None) -> list[str]:
    """The lines of file `path`, or of stdin when `path` is None or empty."""
    if path:
        with open(path, "rb") as f:
            return read_lines(f.read(), path)
    return read_lines(sys.stdin.buffer.read(), "stdin")


def check_output(path: str | None) -> None:
    """Raises ValueError, before any work, when file `path` could not be written."""
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"output {path} is a directory: give a file name")
    if not os.path.isdir(directory):
        raise ValueError(f"output {path}: directory {directory} does not exist: create it")
    if not os.access(path if os.path.exists(path) else directory, os.W_OK):
        raise ValueError(f"output {path} is not writable here: give another --output")


def write_output(texts: Sequence[str], path: str | None) -> None:
    """`texts` one a line (line breaks inside a text become spaces) to file `path` (replacing
    it), or to stdout when `path` is None or empty."""
    lines = []
    for text in texts:
        for line_break in _LINE_BREAKS:
            text = text.replace(line_break, " ")
        lines.append(text + "\n")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(lines)
    else:
        sys.stdout.writelines(lines)


def run(process: Callable[[list[str]], Sequence[str]], *, input_path: str | None = None,
        output_path: str | None = None, lines: Sequence[str] | None = None) -> None:
    """Writes `process(lines)` (one output text per line read) to `output_path` or stdout.

    `lines` are those given, else those of file `input_path` or of stdin, read before
    `process` starts, as is the output checked. A ValueError or OSError (unreadable input, an
    output that cannot be written, a mistake `process` names) exits with one line `error: ...`;
    the output is written only once `process` has succeeded, so an earlier output file
    survives a failed run.
    """
    try:
        if lines is None:
            lines = read_input(input_path)
        check_output(output_path)
        texts = process(list(lines))
        write_output(texts, output_path)
    except (ValueError, OSError) as error:
        sys.exit(f"error: {error}")
