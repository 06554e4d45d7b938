"""Text shards as documents: the files a pretraining data set is kept in, read in order.

- `.txt`: the whole file is one document.
- `.jsonl` (or `.json` lines): one document per line, its `text_field` (read with pyarrow).
- `.parquet`: one document per row, its `text_field` column, read a row group at a time (pyarrow).

A data source is a file or a folder; a folder's shards are read in the order of their paths, so every island
sees the same stream. Token files (`.bin`, `.npy`) are already tokens; `diloco tokenize` writes them from text
shards once, so that islands need not tokenise at every start (`diloco.worker.data` does either).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
TOKEN_SUFFIXES = (".bin", ".npy")
TEXT_FIELD = "text"


def shard_files(source: Path, suffixes: tuple[str, ...] = TEXT_SUFFIXES + TOKEN_SUFFIXES) -> list[Path]:
    """The shards of a source: the file itself, or a folder's files with these suffixes (searched recursively,
    sorted by path); refused when there are none."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise FileNotFoundError(f"data source {source} is neither a file nor a folder")
    found = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)
    if not found:
        raise ValueError(f"no shards ({', '.join(suffixes)}) in {source}")
    return found


def is_text(path: Path) -> bool:
    """Whether `path` holds text to tokenise (not token ids). A file of another suffix is text too: its
    bytes, as the byte-level presets read any file."""
    return path.suffix.lower() not in TOKEN_SUFFIXES


def read_documents(path: Path, text_field: str = TEXT_FIELD) -> Iterator[str]:
    """The documents of one text shard, in file order."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        import pyarrow.json as pj

        table = pj.read_json(path)
        yield from _column(table, text_field, path)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        reader = pq.ParquetFile(path)
        if text_field not in reader.schema_arrow.names:
            raise ValueError(f"{path} has no column {text_field!r} (columns: {', '.join(reader.schema_arrow.names)})")
        for batch in reader.iter_batches(columns=[text_field]):
            yield from _column(batch, text_field, path)
    else:
        yield path.read_bytes().decode("utf-8", errors="replace")


def _column(table: Any, text_field: str, path: Path) -> Iterator[str]:
    """The non-empty strings of a pyarrow Table's or RecordBatch's `text_field`."""
    if text_field not in table.column_names:
        raise ValueError(f"{path} has no field {text_field!r} (fields: {', '.join(table.column_names)})")
    for value in table.column(text_field).to_pylist():
        if value:
            yield value
