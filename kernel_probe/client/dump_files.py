"""Reading a dump directory's files, which are untrusted input.

A dump directory is given by whoever runs ``connect("dump://DIR")`` or adds it to the
Jupyter server, and it may come from anywhere (copied from a cluster, unpacked from an
archive, shared on a file system others write to). Every file of it is read here and
nowhere else, and nothing in it is believed:

- **Only regular files inside the run directory.** Files are opened with ``O_NOFOLLOW``
  (a symlink is refused, not followed) and ``O_NONBLOCK`` (opening a FIFO never waits for
  a writer), then ``fstat`` must say a regular file (no FIFO, device, socket), and the
  resolved path must lie under the resolved run directory. Rank directories that are
  symlinks are refused the same way.
- **Capped reads.** A manifest is read up to ``MAX_MANIFEST_BYTES``, a fatal signal's
  traceback up to ``MAX_FATAL_BYTES`` (cut, with a note); a Parquet table is opened, its
  footer's row count and uncompressed size checked against ``MAX_TABLE_ROWS`` and
  ``MAX_TABLE_BYTES`` (pyarrow's metadata) before any of its data is read, so a small file
  that would inflate to gigabytes is refused.
- **A schema for the manifest** (``check_manifest``): the fields the reader uses, with
  their types; JSON nested too deep is refused, not a ``RecursionError``. Its sizes are
  checked against the ranks actually present (``check_world_sizes``): a ``world_size``
  beyond ``MAX_WORLD_SIZE``, or one that does not hold the ranks present, is not believed.
  A rank number, from a directory's name or a manifest, is below ``MAX_WORLD_SIZE`` and
  the two agree.
- **One line per bad rank.** Every refusal is a ``BadDumpFile`` (a ``ValueError``) whose
  text is one line naming the file; the caller keeps it as that rank's problem and the
  other ranks still load.

A deadline for the whole read is the caller's: the Jupyter server runs the dump reader on
a thread pool of its own, under a deadline (the Jupyter server's ``ClusterClients``).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..tags import TAG_TYPES

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

MAX_MANIFEST_BYTES = 16 << 20  # a manifest holds the membership view: ~1 KB a rank
MAX_FATAL_BYTES = 1 << 20  # faulthandler's traceback of every thread
MAX_TABLE_FILE_BYTES = 256 << 20  # a rank writes at most PROBING_DUMP_MAX_MB (4 MB) of tables
MAX_TABLE_ROWS = 20_000_000
MAX_TABLE_BYTES = 512 << 20  # uncompressed, as the footer counts it
MAX_FOOTER_CHUNKS = 1_000_000  # row groups x columns, before they are summed
MAX_WORLD_SIZE = 1 << 16
MAX_ENTRIES = 100_000  # names listed in one directory

RANK_DIR = re.compile(r"rank(\d{1,9})\Z")
FATAL = re.compile(r"rank(\d{1,9})\.fatal\.txt\Z")
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class BadDumpFile(ValueError):
    """A file of a dump that is refused; its text is one line naming the file."""


def _label(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return path.name


def open_regular(path: Path, root: Path) -> int:
    """A read-only descriptor of ``path``, a regular file under ``root`` (the run directory)
    reached through no symlink; ``BadDumpFile`` otherwise."""
    label = _label(path, root)
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, real_root]) != real_root:
        raise BadDumpFile(f"{label}: a link out of the dump directory: not read")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        why = "a symlink: not read" if os.path.islink(path) else (exc.strerror or type(exc).__name__)
        raise BadDumpFile(f"{label}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadDumpFile(f"{label}: not a regular file (a FIFO, a device or a socket): not read")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_capped(path: Path, root: Path, limit: int, *, cut: bool = False) -> tuple[bytes, os.stat_result, bool]:
    """``path``'s bytes (at most ``limit``), its stat, and whether it was longer. Longer than
    ``limit``: ``BadDumpFile``, unless ``cut`` (then the first ``limit`` bytes)."""
    fd = open_regular(path, root)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        data = fh.read(limit + 1)
    longer = len(data) > limit
    if longer and not cut:
        raise BadDumpFile(f"{_label(path, root)}: larger than {limit >> 20} MB: not read")
    return data[:limit], st, longer


def entries(directory: Path) -> list[os.DirEntry]:
    """The entries of ``directory``, sorted by name (at most ``MAX_ENTRIES``)."""
    out: list[os.DirEntry] = []
    with os.scandir(directory) as it:
        for entry in it:
            out.append(entry)
            if len(out) >= MAX_ENTRIES:
                break
    return sorted(out, key=lambda e: e.name)


def is_real_dir(entry: os.DirEntry) -> bool:
    """A directory, and not a symlink to one."""
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def rank_of(match: re.Match) -> int | None:
    rank = int(match.group(1))
    return rank if rank < MAX_WORLD_SIZE else None


# --- the manifest ----------------------------------------------------------------------------
_INT = (int,)
_NUM = (int, float)
_OPT_STR = (str, type(None))
_OPT_INT = (int, type(None))


@dataclass(frozen=True)
class Field:
    types: tuple
    required: bool = False


# the fields of dump.json the reader uses (postmortem.dump.write_dump writes them), and their types
MANIFEST_FIELDS: dict[str, Field] = {
    "format": Field(_INT, required=True),
    "tags": Field((dict,), required=True),
    "run_id": Field(_OPT_STR),
    "identity": Field((dict, type(None))),
    "written_at": Field(_NUM + (type(None),)),
    "reasons": Field((list, type(None))),
    "nodes": Field((dict, type(None))),
    "tables": Field((dict, type(None))),
    "skipped": Field((dict, type(None))),
}
# the tag columns as declared once (kernel_probe.tags): the rank required, the others may be null
TAG_FIELDS: dict[str, Field] = {name: Field(_INT, required=True) if name == "_rank" else
                                Field(_OPT_INT if kind == "int64" else _OPT_STR) for name, kind in TAG_TYPES.items()}
IDENTITY_FIELDS: dict[str, Field] = {"world_size": Field(_OPT_INT), "rank": Field(_OPT_INT)}
NODES_FIELDS: dict[str, Field] = {"members": Field((list, type(None))), "departures": Field((list, type(None))),
                                  "epoch": Field(_OPT_INT)}


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check(obj: dict, fields: dict[str, Field], where: str) -> None:
    for name, spec in fields.items():
        if name not in obj:
            if spec.required:
                raise BadDumpFile(f"{where}: no '{name}'")
            continue
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, spec.types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in spec.types)
            raise BadDumpFile(f"{where}: '{name}' is {_type_name(value)}, expected {want}")


def check_manifest(manifest: Any, where: str, rank: int | None = None) -> dict:
    """``manifest`` if it has the shape of a dump's manifest (its rank ``rank``, from its
    directory's name); ``BadDumpFile`` naming the first field that is wrong."""
    if not isinstance(manifest, dict):
        raise BadDumpFile(f"{where}: not a probing dump's manifest (a JSON {_type_name(manifest)})")
    _check(manifest, MANIFEST_FIELDS, where)
    _check(manifest["tags"], TAG_FIELDS, f"{where}: tags")
    _check(manifest.get("identity") or {}, IDENTITY_FIELDS, f"{where}: identity")
    nodes = manifest.get("nodes") or {}
    _check(nodes, NODES_FIELDS, f"{where}: nodes")
    for key in ("members", "departures"):
        if not all(isinstance(m, dict) for m in nodes.get(key) or ()):
            raise BadDumpFile(f"{where}: nodes.{key} holds something other than records")
    tagged = manifest["tags"]["_rank"]
    if not 0 <= tagged < MAX_WORLD_SIZE:
        raise BadDumpFile(f"{where}: rank {tagged} is out of range (0 to {MAX_WORLD_SIZE - 1})")
    if rank is not None and tagged != rank:
        raise BadDumpFile(f"{where}: says rank {tagged}, in the directory of rank {rank}")
    return manifest


def read_manifest(path: Path, root: Path, rank: int | None = None) -> dict:
    """A rank's ``dump.json``, read capped and checked against the schema."""
    data, _st, _ = read_capped(path, root, MAX_MANIFEST_BYTES)
    where = _label(path, root)
    try:
        manifest = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise BadDumpFile(f"{where}: JSON nested too deep") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadDumpFile(f"{where}: unreadable: {str(exc).splitlines()[0]}") from None
    return check_manifest(manifest, where, rank)


def check_world_sizes(manifests: dict[int, dict]) -> dict[int, str]:
    """The ``world_size`` each manifest claims, checked against the ranks present: a claim
    beyond ``MAX_WORLD_SIZE`` or one that does not hold its own rank is dropped from the
    manifest (the rank still loads). Returns rank -> why, for each claim dropped."""
    dropped: dict[int, str] = {}
    for rank, manifest in manifests.items():
        identity = manifest.get("identity") or {}
        size = identity.get("world_size")
        if size is None:
            continue
        if not rank < size <= MAX_WORLD_SIZE:
            dropped[rank] = (f"rank {rank}: its world_size {size} is not believed "
                             f"({'beyond ' + str(MAX_WORLD_SIZE) if size > MAX_WORLD_SIZE else 'it holds no rank ' + str(rank)})")
            manifest["identity"] = {**identity, "world_size": None}
    return dropped


# --- a fatal signal's traceback ----------------------------------------------------------------
def read_fatal(path: Path, root: Path) -> tuple[str, float]:
    """faulthandler's traceback (cut at ``MAX_FATAL_BYTES``, with a note) and when it was written."""
    data, st, longer = read_capped(path, root, MAX_FATAL_BYTES, cut=True)
    text = data.decode("utf-8", errors="replace")
    if longer:
        text += f"\n[cut at {MAX_FATAL_BYTES >> 20} MB by the dump reader]\n"
    return text, st.st_mtime


# --- Parquet tables ------------------------------------------------------------------------------------
def _fixed_width(t: pa.DataType) -> int:
    """Bytes a row of a column of type ``t`` takes in Arrow beyond its variable-size data."""
    import pyarrow as pa

    try:
        return max(1, t.bit_width // 8)
    except (ValueError, TypeError, AttributeError):  # strings, lists, structs: offsets, then their data
        return 8 if not pa.types.is_struct(t) else sum(_fixed_width(f.type) for f in t)


def _is_text(t: pa.DataType) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) \
        or pa.types.is_large_binary(t)


@contextmanager
def _parquet(path: Path, root: Path, *, text_as_dictionary: bool = False) -> Iterator[pq.ParquetFile]:
    """``path`` opened as Parquet, its footer checked before any data is read: its rows,
    and the Arrow size they take at least (fixed-width columns) plus the pages' size before
    compression. ``text_as_dictionary``: string columns read dictionary-encoded, as stored
    (a dictionary page holding one long string, repeated by every row, is checked before
    it is expanded: ``read_table``)."""
    import pyarrow.parquet as pq

    label = _label(path, root)
    with os.fdopen(open_regular(path, root), "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_TABLE_FILE_BYTES:
            raise BadDumpFile(f"{label}: a {size >> 20} MB file, more than {MAX_TABLE_FILE_BYTES >> 20} MB: not read")
        try:
            pf = pq.ParquetFile(fh)
            schema = pf.schema_arrow
        except Exception as exc:
            raise BadDumpFile(f"{label}: not a Parquet file: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        md = pf.metadata
        if not 0 <= md.num_rows <= MAX_TABLE_ROWS:
            raise BadDumpFile(f"{label}: {md.num_rows} rows, more than {MAX_TABLE_ROWS}: not read")
        if md.num_row_groups * max(1, md.num_columns) > MAX_FOOTER_CHUNKS:
            raise BadDumpFile(f"{label}: {md.num_row_groups} row groups: not read")
        inflated = md.num_rows * sum(_fixed_width(f.type) for f in schema)
        for i in range(md.num_row_groups):
            group = md.row_group(i)
            inflated += max(group.total_byte_size,
                            sum(group.column(j).total_uncompressed_size for j in range(group.num_columns)))
            if inflated > MAX_TABLE_BYTES:
                break
        if inflated > MAX_TABLE_BYTES:
            raise BadDumpFile(f"{label}: inflates to more than {MAX_TABLE_BYTES >> 20} MB "
                              f"({max(1, size >> 10)} KB on disk): not read")
        if text_as_dictionary:
            pf.close()
            fh.seek(0)
            pf = pq.ParquetFile(fh, metadata=md, read_dictionary=[f.name for f in schema if _is_text(f.type)])
        with pf:
            yield pf


def read_table(path: Path, root: Path) -> pa.Table:
    """A dump's table, once its footer says it fits, and its strings once their expanded
    size does (``BadDumpFile`` otherwise)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    with _parquet(path, root, text_as_dictionary=True) as pf:
        table = pf.read()
    expanded = table.nbytes
    for i, f in enumerate(table.schema):
        if pa.types.is_dictionary(f.type):
            for chunk in table.column(i).chunks:
                lengths = pc.binary_length(chunk.dictionary).take(chunk.indices)
                expanded += int(pc.sum(lengths).as_py() or 0) + 8 * len(chunk)
        if expanded > MAX_TABLE_BYTES:
            raise BadDumpFile(f"{_label(path, root)}: its strings expand to more than {MAX_TABLE_BYTES >> 20} MB: "
                              "not read")
    columns = [pa.chunked_array([c.dictionary_decode() for c in col.chunks], col.type.value_type)
               if pa.types.is_dictionary(col.type) and _is_text(col.type.value_type) else col
               for col in table.columns]
    fields = [pa.field(f.name, c.type, f.nullable, f.metadata) for f, c in zip(table.schema, columns)]
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=table.schema.metadata))


def read_columns(path: Path, root: Path) -> list[str]:
    """A table's column names, from its footer."""
    with _parquet(path, root) as pf:
        return list(pf.schema_arrow.names)
