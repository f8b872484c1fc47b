"""Reading one shard of the user's files: `jsonl` (also `.gz`, `.zst`), `parquet`, `text`
(one document a line), `text_paragraphs` (a blank line between documents) or `arrayrecord`
(each record a JSON object, or UTF-8 text). A shard is read whole.

A document is the value of named fields (`data.text_field`, dotted for nested fields such as
`meta.text`). Bad input is one line naming the file: a missing field (with the fields the
file has), a malformed jsonl line (file:line; `data.skip_bad_lines=True` skips and counts
them instead), a parquet column that is not text, a file without documents, non-UTF-8 bytes.
"""

from __future__ import annotations

import contextlib
import io
import json

from transformer.data.file_specs import BadData


def _open(path: str, mode: str = "rb"):
    import fsspec

    return fsspec.open(path, mode, compression="infer")


def _lookup(record, field: str, where: str, *, what: str, setting: str):
    """record[a][b]... for `field` "a.b...", or one line naming what the record has."""
    value = record
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            have = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise BadData(f"{where}: no {what} {field!r} (it has {have}); set {setting} to "
                          f"one of them")
        value = value[part]
    return value


def _field(record, field: str, where: str) -> str:
    value = _lookup(record, field, where, what="field",
                    setting="the field setting (data.text_field, ...)")
    if not isinstance(value, str):
        raise BadData(f"{where}: field {field!r} is {type(value).__name__}, not text")
    return value


def _label(record, field: str, where: str) -> int | str:
    value = _lookup(record, field, where, what="label field", setting="data.label_field")
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise BadData(f"{where}: label {field!r} is {type(value).__name__}, not an integer or "
                      f"a class name")
    return value


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadData(f"{where}: not UTF-8 (byte {e.start}); re-encode the file as UTF-8") from None


def check_parquet_schema(schema, fields: tuple[str, ...], path: str,
                         label_field: str | None = None) -> None:
    """Each (dotted) field is a string column of a parquet file's schema (the label an integer
    or string one), else one line."""
    import pyarrow as pa

    for field in fields + ((label_field,) if label_field else ()):
        parts = field.split(".")
        if parts[0] not in schema.names:
            raise BadData(f"{path}: no column {parts[0]!r} (it has {schema.names}); "
                          f"set the field setting (data.text_field, ...) to one of them")
        kind = schema.field(parts[0]).type
        for depth, part in enumerate(parts[1:], 1):
            if not pa.types.is_struct(kind) or kind.get_field_index(part) < 0:
                raise BadData(f"{path}: column {'.'.join(parts[:depth])!r} ({kind}) has no "
                              f"field {part!r}")
            kind = kind.field(part).type
        if field == label_field and pa.types.is_integer(kind):
            continue
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise BadData(f"{path}: column {field!r} is {kind}, not a string; choose a text "
                          f"column")


class ShardReader:
    """Reads one shard's documents as tuples of the wanted fields, and counts its rows."""

    def __init__(self, fmt: str, fields: tuple[str, ...], skip_bad_lines: bool,
                 label_field: str | None = None):
        self.fmt, self.fields, self.skip_bad_lines = fmt, fields, skip_bad_lines
        self.label_field = label_field
        self.skipped = 0
        if label_field and fmt.startswith("text"):
            raise BadData(f"data.label_field={label_field!r}: {fmt} files hold no labels; use "
                          f"jsonl, parquet or arrayrecord")

    def read(self, path: str) -> list[tuple[str, ...]]:
        rows = getattr(self, f"_{self.fmt}")(path)
        if not rows:
            raise BadData(f"{path} has no documents; remove it or fix the glob")
        return rows

    def count(self, path: str) -> int:
        """Rows of one shard: parquet's metadata or ArrayRecord's index, else a read of the
        shard. A read is not kept: memory stays that of the cached shards whatever the
        corpus."""
        if self.fmt == "arrayrecord":
            from array_record.python.array_record_module import ArrayRecordReader

            with contextlib.closing(ArrayRecordReader(path)) as reader:
                rows = reader.num_records()
        elif self.fmt == "parquet":
            import pyarrow.parquet as pq

            with _open(path) as f:
                parquet = pq.ParquetFile(f)
                check_parquet_schema(parquet.schema_arrow, self.fields, path, self.label_field)
                rows = parquet.metadata.num_rows
        else:
            return len(self.read(path))
        if not rows:
            raise BadData(f"{path} has no documents; remove it or fix the glob")
        return rows

    def _record(self, record, where: str) -> tuple:
        texts = tuple(_field(record, f, where) for f in self.fields)
        return texts + (_label(record, self.label_field, where),) if self.label_field else texts

    def _jsonl(self, path: str) -> list[tuple[str, ...]]:
        rows = []
        with _open(path) as f:
            data = f.read()
        for number, line in enumerate(data.split(b"\n"), 1):
            text = _decode(line, f"{path}:{number}").strip()
            if not text:
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                if self.skip_bad_lines:
                    self.skipped += 1
                    continue
                raise BadData(f"{path}:{number}: malformed JSON ({e.msg}); fix the line or "
                              f"set data.skip_bad_lines=True to skip and count such lines"
                              ) from None
            rows.append(self._record(record, f"{path}:{number}"))
        return rows

    def _text(self, path: str) -> list[tuple[str, ...]]:
        with _open(path) as f:
            lines = _decode(f.read(), path).splitlines()
        return [(line,) for line in lines if line.strip()]

    def _text_paragraphs(self, path: str) -> list[tuple[str, ...]]:
        with _open(path) as f:
            text = _decode(f.read(), path)
        paragraphs = (p.strip() for p in text.replace("\r\n", "\n").split("\n\n"))
        return [(p,) for p in paragraphs if p]

    def _parquet(self, path: str) -> list[tuple[str, ...]]:
        import pyarrow.parquet as pq

        with _open(path) as f:
            table = pq.read_table(io.BytesIO(f.read()))
        check_parquet_schema(table.schema, self.fields, path, self.label_field)
        columns = []
        for field in self.fields + ((self.label_field,) if self.label_field else ()):
            parts = field.split(".")
            column = table.column(parts[0]).combine_chunks()
            for part in parts[1:]:
                column = column.field(part)
            columns.append(column.to_pylist())
        return [tuple("" if v is None else v for v in row) for row in zip(*columns, strict=True)]

    def _arrayrecord(self, path: str) -> list[tuple[str, ...]]:
        from array_record.python.array_record_module import ArrayRecordReader

        with contextlib.closing(ArrayRecordReader(path)) as reader:
            records = reader.read_all()
        rows = []
        for i, data in enumerate(records):
            text = _decode(data, f"{path} record {i}")
            if text.lstrip().startswith("{"):
                rows.append(self._record(json.loads(text), f"{path} record {i}"))
            else:
                rows.append((text,) * len(self.fields))
        return rows
