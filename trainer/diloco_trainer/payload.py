"""Payloads in pieces: a safetensors header, then each tensor's own bytes, never joined.

A download of a fragment's values, or of the whole model, is arrays the syncer already holds.
Encoding them into one bytes object first (what safetensors' `save` does) makes a second copy
of everything sent: 4 more bytes per parameter for as long as that copy lives, the whole model
for a full pull. Here the header is built alone and a response writes the arrays' memory
directly, a slice at a time (`Pieces.slices`), so a download costs no copy beyond the socket's
buffer. Merges never write into the arrays they publish (they make new ones), so a slow reader
keeps sending the version it started with.

The layout is safetensors' own (what `safetensors.numpy.load` reads): an 8-byte little-endian
header length, a JSON header padded with spaces to 8 bytes, then the tensors back to back in
the header's offset order, largest item size first so every tensor stays aligned.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

SLICE_BYTES = 1 << 20  # what a response writes at once: the transport buffers about this much

_DTYPES = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}


@dataclass(frozen=True)
class Pieces:
    """One payload: `head` then `chunks` (views of the tensors' memory, not copies)."""

    head: bytes
    chunks: tuple[memoryview, ...] = ()

    @property
    def size(self) -> int:
        return len(self.head) + sum(c.nbytes for c in self.chunks)

    def joined(self) -> bytes:
        return b"".join([self.head, *self.chunks])

    def slices(self, limit: int = SLICE_BYTES) -> Iterator[memoryview]:
        """The payload in order, no piece longer than `limit` bytes."""
        for piece in (memoryview(self.head), *self.chunks):
            for start in range(0, piece.nbytes, limit):
                yield piece[start : start + limit]


def safetensors_pieces(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> Pieces:
    """`tensors` as a safetensors payload with `metadata`, in pieces."""
    # np.require, not np.ascontiguousarray: that one turns a 0-d array into shape (1,).
    arrays = {name: np.require(a, requirements="C") for name, a in tensors.items()}
    for name, a in arrays.items():
        if a.dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} has no safetensors name here")
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        a = arrays[name]
        header[name] = {
            "dtype": _DTYPES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    chunks = tuple(arrays[n].reshape(-1).view(np.uint8).data for n in order)
    return Pieces(len(text).to_bytes(8, "little") + text, chunks)
