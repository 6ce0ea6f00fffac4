"""A GGUF file read with the `gguf` package (llama.cpp's own reader), every offset and size
checked against the file before any byte of a tensor is used.

GGUFReader parses the header (metadata and tensor infos) from a read-only memory map; its
step that turns tensor infos into arrays is replaced here by one that checks first: the
block type is one tilegraph describes (ir/block_formats.py), the dims are positive and their
product fits in 63 bits, each row is a whole number of blocks, each tensor's data starts
aligned, inside the file, ends inside it, and overlaps no other tensor. Each failure is its
own error class (all `GGUFError`, a ModelError: `tilegraph` exits 2 with one paragraph).
Tensor data stay views of the map: a 100 MB file is not read into memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tilegraph.ir.block_formats import BY_GGML_TYPE, BlockFormat
from tilegraph.ir.model import ModelError

MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = (1 << 63) - 1  # a tensor's element count must fit ggml's int64_t


class GGUFError(ModelError):
    """A GGUF file tilegraph cannot use; the subclass names what is wrong."""


class GGUFHeaderError(GGUFError):
    """The header (magic, version, metadata, tensor infos) is malformed or cut short."""


class GGUFTruncatedError(GGUFError):
    """A tensor's data run past the end of the file."""


class GGUFOffsetError(GGUFError):
    """A tensor's data offset lies past the end of the file, or is not aligned."""


class GGUFOverlapError(GGUFError):
    """Two tensors' data share bytes."""


class GGUFDimsError(GGUFError):
    """A tensor's dims are not positive, too many, or their product overflows 63 bits."""


class GGUFBlockTypeError(GGUFError):
    """A tensor's type is not one of the block formats tilegraph reads (or not a ggml type at all),
    or its rows are not a whole number of blocks."""


class GGUFArchitectureError(GGUFError):
    """general.architecture names a model family the GGUF frontend does not build."""


class GGUFMetadataError(GGUFError):
    """A metadata key the model needs is missing or of the wrong kind, or a tensor is missing
    or of the wrong shape."""


@dataclass(frozen=True)
class Tensor:
    name: str
    format: BlockFormat
    dims: tuple[int, ...]  # GGUF order: dims[0] is the innermost (a row's length)
    offset: int  # absolute byte offset in the file
    nbytes: int
    raw: np.ndarray  # uint8 view of the map: [rows, row_bytes]

    @property
    def shape(self) -> tuple[int, ...]:
        """NumPy order: (..., rows, k)."""
        return tuple(reversed(self.dims))

    def dequantize(self) -> np.ndarray:
        """float32 values (for small tensors: norms, biases; never a whole weight matrix)."""
        return self.format.dequantize(self.raw, self.shape)


def _reader_class():
    from gguf import GGUFReader

    class CheckedReader(GGUFReader):
        """GGUFReader whose tensor step checks every info against the file before making views."""

        # GGUFReader slices its map once per value it reads (a million times for a vocabulary of
        # 262k tokens), and np.memmap's __getitem__/__array_finalize__ on every slice were most of
        # the parse: it reads a plain read-only ndarray view of the same map instead.
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            self.checked = check_tensors(self.data, int(start_offs), int(self.alignment), fields)
            self.tensors = []

    return CheckedReader


def check_tensors(data: np.ndarray, start: int, alignment: int, fields: list) -> dict[str, Tensor]:
    size = int(data.size)
    out: dict[str, Tensor] = {}
    for field in fields:
        _len, name_data, n_dims, dims, raw_type, offset = field.parts
        name = field.name
        if name in out:
            raise GGUFHeaderError(f"tensor '{name}' is described twice")
        n = int(n_dims[0]) if len(n_dims) else -1
        dims_list = [int(d) for d in dims.tolist()]
        if not 1 <= n <= MAX_DIMS or len(dims_list) != n:
            raise GGUFDimsError(f"tensor '{name}' has {n} dims; GGUF allows 1 to {MAX_DIMS}")
        count = 1
        for d in dims_list:
            if d <= 0:
                raise GGUFDimsError(f"tensor '{name}' has a dim of {d} in {dims_list}")
            count *= d
        if count > MAX_ELEMENTS:
            raise GGUFDimsError(f"tensor '{name}': the product of its dims {dims_list} overflows 63 bits")
        ggml_type = int(raw_type[0]) if len(raw_type) else -1
        fmt = BY_GGML_TYPE.get(ggml_type)
        if fmt is None:
            try:
                from gguf import GGMLQuantizationType

                what = f"type {GGMLQuantizationType(ggml_type).name}"
            except ValueError:
                what = f"type number {ggml_type}, which is no ggml type"
            raise GGUFBlockTypeError(f"tensor '{name}' is of {what}; tilegraph reads "
                                     + ", ".join(f.name.upper() for f in BY_GGML_TYPE.values()))
        if dims_list[0] % fmt.block:
            raise GGUFBlockTypeError(f"tensor '{name}': rows of {dims_list[0]} values are not a whole number of "
                                     f"{fmt.name} blocks of {fmt.block}")
        nbytes = count // fmt.block * fmt.block_bytes
        rel = int(offset[0]) if len(offset) else -1
        begin = start + rel
        if rel % alignment:
            raise GGUFOffsetError(f"tensor '{name}': its data offset {rel} is not a multiple of the alignment "
                                  f"{alignment}")
        if begin >= size:
            raise GGUFOffsetError(f"tensor '{name}': its data offset {rel} (byte {begin}) lies past the end of "
                                  f"the file ({size} bytes)")
        if begin + nbytes > size:
            raise GGUFTruncatedError(f"tensor '{name}': its {nbytes} bytes at byte {begin} run past the end of "
                                     f"the file ({size} bytes): the file is truncated")
        rows = count // dims_list[0]
        raw = data[begin:begin + nbytes].reshape(rows, fmt.row_bytes(dims_list[0]))
        out[name] = Tensor(name, fmt, tuple(dims_list), begin, nbytes, raw)
    spans = sorted(out.values(), key=lambda t: t.offset)
    for a, b in zip(spans, spans[1:]):
        if b.offset < a.offset + a.nbytes:
            raise GGUFOverlapError(f"tensors '{a.name}' (bytes {a.offset}..{a.offset + a.nbytes}) and '{b.name}' "
                                   f"(from byte {b.offset}) overlap")
    return out


class GGUFFile:
    """Metadata (key -> Python value) and checked tensors of one GGUF file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"no such GGUF file: {self.path}")
        try:
            reader = _reader_class()(self.path, "r")
        except GGUFError:
            raise
        except (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError, MemoryError,
                AttributeError) as e:
            raise GGUFHeaderError(f"{self.path} is not a GGUF file tilegraph can read: its header is malformed "
                                  f"or cut short ({type(e).__name__}: {e})") from None
        self.tensors: dict[str, Tensor] = reader.checked
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except (ValueError, IndexError, UnicodeDecodeError) as e:
                raise GGUFHeaderError(f"{self.path}: metadata '{key}' is malformed ({type(e).__name__}: {e})") from None

    def get(self, key: str, kind: type | tuple = object, default: Any = ...) -> Any:
        """Metadata `key`, checked to be of `kind`; a GGUFMetadataError if missing (and no default)."""
        if key not in self.metadata:
            if default is ...:
                raise GGUFMetadataError(f"{self.path}: metadata '{key}' is missing")
            return default
        value = self.metadata[key]
        if kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if kind is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise GGUFMetadataError(f"{self.path}: metadata '{key}' is {type(value).__name__} {value!r:.80}, "
                                    f"not {getattr(kind, '__name__', kind)}")
        return value

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> Tensor:
        if name not in self.tensors:
            raise GGUFMetadataError(f"{self.path}: tensor '{name}' is missing")
        t = self.tensors[name]
        if shape is not None and t.shape != tuple(shape):
            raise GGUFMetadataError(f"{self.path}: tensor '{name}' is {t.shape}, the metadata say {tuple(shape)}")
        return t
