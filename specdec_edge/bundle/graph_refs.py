"""The files an ONNX graph reads besides itself: the ``location`` of every tensor stored as external data.

ONNX lets any tensor of a graph (an initializer, a ``Constant``'s value, a tensor of a subgraph or of a
function) name a file beside the graph; ONNX Runtime reads it without any check. ``external_data_files``
lists those names by walking the protobuf wire format directly (no ``onnx`` package: the light runtime
has none), skipping over weights stored in the graph itself, so that loading can refuse a graph that reads
a file its bundle's manifest does not list (and hash).

The ONNX messages and field numbers read here (onnx/onnx.proto3):

    ModelProto        graph = 7, functions = 25 (FunctionProto: node = 7)
    GraphProto        node = 1, initializer = 5, sparse_initializer = 15
    NodeProto         attribute = 5
    AttributeProto    t = 5, g = 6, tensors = 10, graphs = 11, sparse_tensor = 22, sparse_tensors = 23
    SparseTensorProto values = 1, indices = 2
    TensorProto       external_data = 13 (StringStringEntryProto: key = 1, value = 2), data_location = 14
"""

from __future__ import annotations

import mmap
from pathlib import Path

_MAX_DEPTH = 64  # subgraphs nest this deep at most (deeper: the file is refused as malformed)


class GraphFormatError(ValueError):
    """The bytes are not a well-formed ONNX protobuf."""


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise GraphFormatError("a truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf, start: int, end: int):
    """(field number, start, end) of every length-delimited field in ``buf[start:end]``; other fields skipped."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos, end)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _varint(buf, pos, end)
            if pos + length > end:
                raise GraphFormatError("a field runs past the end of its message")
            yield number, pos, pos + length
            pos += length
        else:
            raise GraphFormatError(f"wire type {wire}")
    if pos != end:
        raise GraphFormatError("a field runs past the end of its message")


def _tensor(buf, start, end, found: set) -> None:
    for number, s, e in _fields(buf, start, end):
        if number == 13:  # external_data: {key, value}
            entry = {n: bytes(buf[a:b]) for n, a, b in _fields(buf, s, e)}
            if entry.get(1) == b"location":
                try:
                    found.add(entry.get(2, b"").decode("utf-8"))
                except UnicodeDecodeError:
                    raise GraphFormatError("an external data location that is not UTF-8") from None


def _sparse(buf, start, end, found: set) -> None:
    for number, s, e in _fields(buf, start, end):
        if number in (1, 2):
            _tensor(buf, s, e, found)


def _node(buf, start, end, found: set, depth: int) -> None:
    for number, s, e in _fields(buf, start, end):
        if number != 5:  # attribute
            continue
        for field, a, b in _fields(buf, s, e):
            if field in (5, 10):
                _tensor(buf, a, b, found)
            elif field in (6, 11):
                _graph(buf, a, b, found, depth + 1)
            elif field in (22, 23):
                _sparse(buf, a, b, found)


def _graph(buf, start, end, found: set, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise GraphFormatError(f"subgraphs nested deeper than {_MAX_DEPTH}")
    for number, s, e in _fields(buf, start, end):
        if number == 1:
            _node(buf, s, e, found, depth)
        elif number == 5:
            _tensor(buf, s, e, found)
        elif number == 15:
            _sparse(buf, s, e, found)


def external_data_files(path: Path | str) -> set[str]:
    """The ``location`` of every external-data tensor of the ONNX model in ``path`` (as written, relative to
    the graph's folder). A ``GraphFormatError`` when the file is not a well-formed ONNX protobuf."""
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            raise GraphFormatError("an empty file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            found: set[str] = set()
            for number, s, e in _fields(buf, 0, len(buf)):
                if number == 7:
                    _graph(buf, s, e, found, 0)
                elif number == 25:  # functions: their nodes' attributes may hold tensors too
                    for field, a, b in _fields(buf, s, e):
                        if field == 7:
                            _node(buf, a, b, found, 0)
            return found
