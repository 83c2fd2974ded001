"""A GGUF file's metadata and tensor table, read in milliseconds; the tensors memory-mapped.

The ``gguf`` package's reader makes a numpy view for every string of the metadata, which takes
seconds for a tokenizer's vocabulary and merges (50k-150k strings). This one keeps scalars and
strings, and for arrays only where they are: an array is decoded when asked for.

File layout (GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count u64, metadata
count u64; each metadata entry a string key, a u32 value type and the value; each tensor entry a
string name, u32 dimension count, u64 dimensions (innermost first), u32 ggml type and a u64
offset into the data section, which starts at the next multiple of ``general.alignment``
(default 32) after the entries.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types: (struct code, size) of the fixed-size ones; 8 is a string, 9 an array.
_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}  # fmt: skip
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
STRING, ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader understands."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: GGUF name, ggml type id, dimensions (innermost first), and where
    its bytes are (offset from the file's start, length)."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int
    num_bytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type {self.ggml_type}"


@dataclass(frozen=True)
class ArrayRef:
    """A metadata array not yet decoded: its item type, length and position in the file."""

    item_type: int
    count: int
    offset: int


class GGUFFile:
    """The metadata and tensor table of ``path``; ``data(entry)`` maps a tensor's bytes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._buf = f.read(1 << 16)
            self._file = f
            self._size = self.path.stat().st_size
            self._pos = 0
            self._base = 0
            if self._take(4) != MAGIC:
                raise GGUFFormatError(f"{self.path} is not a GGUF file (no GGUF magic)")
            self.version = self._scalar(4)
            if self.version not in (2, 3):
                raise GGUFFormatError(f"{self.path}: GGUF version {self.version} is not read")
            tensor_count, kv_count = self._scalar(10), self._scalar(10)
            self.metadata: dict[str, Any] = {}
            for _ in range(kv_count):
                key = self._string()
                self.metadata[key] = self._value(self._scalar(4))
            entries = []
            for _ in range(tensor_count):
                name = self._string()
                dims = tuple(self._scalar(10) for _ in range(self._scalar(4)))
                ggml_type, offset = self._scalar(4), self._scalar(10)
                entries.append((name, dims, ggml_type, offset))
            alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
            start = -(-self._where() // alignment) * alignment
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._map = np.frombuffer(self._mmap, dtype=np.uint8)
        self.tensors: dict[str, TensorEntry] = {}
        for name, dims, ggml_type, offset in entries:
            sizes = GGML_QUANT_SIZES.get(_known_type(ggml_type))  # (block elements, bytes)
            size = 0 if sizes is None else int(np.prod(dims, dtype=np.int64)) // sizes[0] * sizes[1]
            entry = TensorEntry(name, ggml_type, dims, start + offset, size)
            if entry.offset + size > len(self._map):
                raise GGUFFormatError(f"{self.path}: tensor {name} runs past the end of the file")
            self.tensors[name] = entry

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value: int, float, bool or str, or a list for an array (decoded now)."""
        value = self.metadata.get(key, default)
        return self.array(value) if isinstance(value, ArrayRef) else value

    def array(self, ref: ArrayRef) -> list[Any]:
        if ref.item_type == STRING:
            out, pos = [], ref.offset
            for _ in range(ref.count):
                (length,) = struct.unpack_from("<Q", self._map, pos)
                out.append(bytes(self._map[pos + 8 : pos + 8 + length]).decode("utf-8", "replace"))
                pos += 8 + length
            return out
        if ref.item_type not in _NUMPY:
            raise GGUFFormatError(f"arrays of type {ref.item_type} are not decoded")
        values = np.frombuffer(self._map, _NUMPY[ref.item_type], ref.count, ref.offset)
        return values.astype(bool).tolist() if ref.item_type == 7 else values.tolist()

    @property
    def mapped(self) -> np.ndarray:
        """The whole file, memory-mapped read-only (the tensors' bytes are views of it)."""
        return self._map

    def data(self, entry: TensorEntry) -> np.ndarray:
        """The tensor's bytes: a read-only uint8 view of the memory map."""
        return self._map[entry.offset : entry.offset + entry.num_bytes]

    def drop_pages(self, entry: TensorEntry) -> None:
        """Unmap the tensor's pages from this process once its bytes were copied (repacked), so
        they stop counting as its resident memory; a later read maps them again from the page
        cache, so this is always safe."""
        if not hasattr(mmap, "MADV_DONTNEED") or entry.num_bytes == 0:
            return
        start = entry.offset - entry.offset % mmap.PAGESIZE
        self._mmap.madvise(mmap.MADV_DONTNEED, start, entry.offset + entry.num_bytes - start)

    # ---- parsing ---------------------------------------------------------------------------
    def _where(self) -> int:
        return self._base + self._pos

    def _take(self, n: int) -> bytes:
        if self._where() + n > self._size:  # also a corrupt length: never read past the end
            raise GGUFFormatError(f"{self.path} ends inside its header")
        if self._pos + n > len(self._buf):  # refill: keep the unread tail, read more
            self._base += self._pos
            self._file.seek(self._base)
            self._buf = self._file.read(max(n, 1 << 20))
            self._pos = 0
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    def _scalar(self, kind: int) -> Any:
        code, size = _SCALARS[kind]
        return struct.unpack(code, self._take(size))[0]

    def _string(self) -> str:
        return self._take(self._scalar(10)).decode("utf-8", "replace")

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._scalar(kind)
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {kind}")
        item_type, count = self._scalar(4), self._scalar(10)
        ref = ArrayRef(item_type, count, self._where())
        if item_type == STRING:
            for _ in range(count):
                self._take(self._scalar(10))
        elif item_type in _SCALARS:
            self._take(_SCALARS[item_type][1] * count)
        else:
            raise GGUFFormatError(f"{self.path}: arrays of type {item_type} are not read")
        return ref


def _known_type(ggml_type: int) -> GGMLQuantizationType | None:
    try:
        return GGMLQuantizationType(ggml_type)
    except ValueError:
        return None  # a type this gguf package does not know: listed, never read
