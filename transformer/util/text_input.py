"""The text a CLI reads and writes (translate, generate): one sentence or prompt a line, from
stdin or a file, to stdout or a file, in order, streamed: lines are read as they are needed, a
chunk at a time, and each chunk's outputs are written and flushed before the next chunk is read,
so memory stays bounded however long the input. Bad input or output ends the program with one
line `error: ...` on stderr.

An interrupted run (Ctrl-C, SIGTERM) leaves a complete prefix of output lines: the signal waits
while a chunk is written, and ends the run between two writes (exit status 128 + the signal's
number, with one line on stderr saying how many lines were written).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import BinaryIO

from transformer.util import progress

# What the readers split on: "\n", "\r\n" and a lone "\r" (as bytes.splitlines). A line break
# inside an output text becomes a space, so output line i always answers input line i.
_LINE_BREAKS = ("\r\n", "\r", "\n")


def _decode(raw: bytes, name: str, number: int) -> str:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{name} line {number} is not UTF-8 ({error.reason} at byte "
                         f"{error.start}): give UTF-8 text") from None
    if "\x00" in line:
        raise ValueError(f"{name} line {number} holds a NUL byte: binary input? give UTF-8 "
                         f"text, one sentence a line")
    return line


def iter_lines(stream: BinaryIO, name: str) -> Iterator[str]:
    """The UTF-8 lines of a binary stream, read as they are asked for (empty input: no lines).
    A line that is not UTF-8 or holds a NUL byte (binary input) raises ValueError naming
    `name` (a file, or stdin) and the line."""
    number = 0
    for raw in stream:
        raw = raw[:-1] if raw.endswith(b"\n") else raw
        raw = raw[:-1] if raw.endswith(b"\r") else raw
        for part in raw.split(b"\r"):
            number += 1
            yield _decode(part, name, number)


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


def one_line(text: str) -> str:
    """`text` with each line break replaced by a space, and a newline at the end."""
    for line_break in _LINE_BREAKS:
        text = text.replace(line_break, " ")
    return text + "\n"


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived. Raised between two writes."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Interrupts:
    """While active, SIGINT and SIGTERM raise `Interrupted`, except inside `writing()`, where
    they wait until the write is done."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self._writing, self._pending, self._previous = False, None, {}

    def __enter__(self):
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        if self._writing:
            self._pending = signum
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def writing(self):
        self._writing = True
        try:
            yield
        finally:
            self._writing = False
        if self._pending is not None:
            raise Interrupted(self._pending)


def _chunks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(lines)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def stream(process: Callable[[list[str], int], Sequence[str]], *, chunk_lines: int,
           input_path: str | None = None, output_path: str | None = None,
           lines: Sequence[str] | None = None, desc: str = "processed",
           unit: str = "line") -> None:
    """Writes `process(chunk, first)` (one output text per line of `chunk`, whose first line is
    line `first` of the input, counted from 0) for consecutive chunks of `chunk_lines` lines.
    Progress (`desc`, counted in `unit`s) on stderr.

    Lines are those given, else those of file `input_path` or of stdin, read one chunk at a
    time. An empty input is one call `process([], 0)` (it may refuse it). The output (file
    `output_path`, replaced, or stdout) is checked first and opened when the first chunk's
    outputs are ready: a failure before that (a workdir that does not load, bad first lines)
    leaves an earlier output file alone. A ValueError or OSError (unreadable input, an output
    that cannot be written, a mistake `process` names) exits with one line `error: ...`. Lines
    written before it stay, whole.
    """
    if chunk_lines < 1:
        raise ValueError(f"chunk_lines={chunk_lines} must be >= 1")
    written = 0
    output = None
    where = output_path or "stdout"
    try:
        check_output(output_path)
        with contextlib.ExitStack() as stack:
            interrupts = stack.enter_context(_Interrupts())
            if lines is None:
                source = (stack.enter_context(open(input_path, "rb")) if input_path
                          else sys.stdin.buffer)
                lines = iter_lines(source, input_path or "stdin")
            bar = stack.enter_context(progress.bar(None, desc, unit=unit))
            chunks = _chunks(lines, chunk_lines)
            for chunk in itertools.chain([next(chunks, [])], chunks):
                texts = process(chunk, written)
                if len(texts) != len(chunk):
                    raise ValueError(f"{len(chunk)} lines gave {len(texts)} outputs")
                if output is None:
                    output = (stack.enter_context(open(output_path, "w", encoding="utf-8"))
                              if output_path else sys.stdout)
                with interrupts.writing():
                    output.write("".join(one_line(text) for text in texts))
                    output.flush()
                    written += len(chunk)
                bar.update(len(chunk))
    except (ValueError, OSError) as error:
        sys.exit(f"error: {error}")
    except Interrupted as interrupted:
        print(f"interrupted ({interrupted}): {written} lines written to {where}, each whole",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + interrupted.signum) from None
