"""A model: one `builtin.module` holding `func.func @forward`, plus its weight store.

The weights never enter the IR text: `tg.weight {name = "fc.weight"}` refers into
the store, which is saved beside the text (`model.mlir` + `model.weights.npz`).
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from xdsl.context import Context
from xdsl.dialects.builtin import Builtin, DictionaryAttr, ModuleOp, StringAttr
from xdsl.dialects.func import Func, FuncOp
from xdsl.ir import Operation
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.utils.exceptions import ParseError, VerifyException

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import TG, TgOp
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.shapes import TensorInfo, info_of
from tilegraph.ir.ops import Op

NAME_ATTR = "tg.name"  # argument / result attribute carrying the user's tensor name
# Argument attribute: this input is donated, updated in place, and result number N is its
# buffer (XLA's input/output aliasing): a KV cache, a weight or moment a step updates.
ALIAS_ATTR = "tg.aliases"


class ModelError(TilegraphError):
    """A model that cannot be loaded or does not verify; the message says why."""


def context() -> Context:
    ctx = Context()
    ctx.load_dialect(Builtin)
    ctx.load_dialect(Func)
    ctx.load_dialect(TG)
    from tilegraph.ir.shard import SHARD  # device grids, sharding annotations, collectives (passes/shard.py)

    ctx.load_dialect(SHARD)
    return ctx


def _linear_string_literals() -> None:
    """xDSL's lexer matches a string literal with `"(?:[^"\\...]+|\\...)*"`: on an unterminated
    one the nested quantifiers backtrack exponentially (a truncated .mlir file of 548 bytes hung
    the parser: found by tilegraph/fuzz.py). The same language, matched possessively: linear."""
    from xdsl.utils.mlir_lexer import MLIRLexer

    MLIRLexer._unescaped_characters_regex = re.compile(r'"(?:[^"\\\n\v\f]|\\(?:["nt\\]|[0-9A-Fa-f]{2}))*+"')


_linear_string_literals()


def parse_module(text: str, source: str = "<string>") -> ModuleOp:
    try:
        op = Parser(context(), text, source).parse_module()
    except ParseError as e:
        raise ModelError(f"{source} is not valid tg IR:\n{e}") from None
    except TilegraphError:
        raise
    except (OverflowError, ValueError, IndexError, KeyError, TypeError, AssertionError, RecursionError) as e:
        # xDSL's parser lets some malformed text through to its attribute constructors
        # (a dense<9223372036854775807> of f32 overflows struct.pack): still a bad file.
        raise ModelError(f"{source} is not valid tg IR: {type(e).__name__}: {e}") from None
    return op


def print_module(module: Operation) -> str:
    import io

    out = io.StringIO()
    Printer(stream=out).print_op(module)
    return out.getvalue() + "\n"


def read_npz(path: str | Path, what: str = "an .npz file") -> dict[str, np.ndarray]:
    """Every array of the .npz at `path`, read whole; a ModelError naming the file for anything
    else (a missing, corrupt or truncated zip, a .npy, pickled objects: never unpickled)."""
    import zipfile
    import zlib

    path = Path(path)
    if not path.is_file():
        raise ModelError(f"no such file: {path} ({what})")
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ModelError(f"{path} is a single .npy array, not {what} (an .npz of named arrays)")
        with data:
            return {k: data[k] for k in data.files}
    except ModelError:
        raise
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error, NotImplementedError) as e:
        raise ModelError(f"{path} is not {what}: {type(e).__name__}: {e}") from None
    except RuntimeError as e:  # zipfile's only RuntimeError on reading: a member flagged encrypted
        raise ModelError(f"{path} is not {what}: {e}") from None


def read_text(path: str | Path, what: str = "tg IR text") -> str:
    """A text file as UTF-8; a ModelError naming the file and the offending byte otherwise."""
    return decode_text(Path(path).read_bytes(), str(path), what)


def decode_text(data: bytes, source: str, what: str = "tg IR text") -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelError(f"{source} is not {what}: byte {e.object[e.start]:#04x} at offset {e.start} is not UTF-8 "
                         "(a binary file?)") from None


class WeightStore(dict):
    """name -> ndarray. Saved as an .npz beside the IR text."""

    def save(self, path: Path) -> None:
        arrays = {k: np.asarray(v) for k, v in self.items()}
        # .npz cannot hold ml_dtypes arrays: store their raw bits and the spelling;
        # 4-bit values two to a byte (low nibble first), with the shape to unpack them.
        plain, meta = {}, {}
        for k, v in arrays.items():
            name = dtypes.dtype_name(v.dtype)
            if name in dtypes.PACKED_4BIT:
                plain[k] = pack_4bit(v)
                meta[k] = (name, tuple(int(d) for d in v.shape))
            elif v.dtype.kind not in "biuf" or name in dtypes.BIT_STORED:
                plain[k] = v.view(np.uint8 if v.dtype.itemsize == 1 else np.uint16)
                meta[k] = name  # type: ignore[assignment]
            else:
                plain[k] = v
        np.savez(path, **plain, __dtypes__=np.array(repr(meta)))

    @classmethod
    def load(cls, path: Path) -> "WeightStore":
        import ast

        def restore(k, raw, meta):
            if k not in meta:
                return raw
            if isinstance(meta[k], tuple):
                name, shape = meta[k]
                return unpack_4bit(raw, shape, name)
            return raw.view(dtypes.numpy_dtype(meta[k]))

        data = read_npz(path, "a weights file")
        try:
            meta = ast.literal_eval(str(data["__dtypes__"])) if "__dtypes__" in data else {}
            return cls({k: restore(k, v, meta) for k, v in data.items() if k != "__dtypes__"})
        except (ValueError, TypeError, KeyError, SyntaxError, MemoryError, RecursionError) as e:
            raise ModelError(f"{path}: the weights' element types (__dtypes__) are malformed: {e}") from None

    def nbytes(self) -> int:
        """Bytes the arrays take when saved (4-bit types two to a byte)."""
        return sum(dtypes.storage_bytes(dtypes.dtype_name(np.asarray(v).dtype), np.asarray(v).size)
                   for v in self.values())


def pack_4bit(array: np.ndarray) -> np.ndarray:
    """A 4-bit array (ml_dtypes int4 / float4_e2m1fn, one value a byte) as bytes holding two values
    each, the first in the low nibble; an odd count is padded with a zero nibble."""
    nibbles = np.asarray(array).reshape(-1).view(np.uint8) & 0x0F
    if nibbles.size % 2:
        nibbles = np.concatenate([nibbles, np.zeros(1, np.uint8)])
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)


def unpack_4bit(packed: np.ndarray, shape: tuple, name: str) -> np.ndarray:
    """The inverse of `pack_4bit`: `shape` values of 4-bit type `name`."""
    count = int(np.prod(shape, dtype=np.int64))
    nibbles = np.empty(packed.size * 2, np.uint8)
    nibbles[0::2] = packed & 0x0F
    nibbles[1::2] = packed >> 4
    # ml_dtypes reads a 4-bit value from the low nibble of its byte (int4 sign-extends it).
    return nibbles[:count].view(dtypes.numpy_dtype(name)).reshape(shape)


def weights_path(mlir_path: Path) -> Path:
    return Path(mlir_path).with_suffix(".weights.npz")


# module -> its weight store, so that a pass, which sees only the module, can read
# and add weights (constant folding does).
_WEIGHTS_OF: "weakref.WeakKeyDictionary[ModuleOp, WeightStore]" = weakref.WeakKeyDictionary()


def weights_of(module: ModuleOp) -> WeightStore:
    """The weight store travelling with `module` (an empty one if it has none yet)."""
    return _WEIGHTS_OF.setdefault(module, WeightStore())


@dataclass(repr=False)
class Model:
    module: ModuleOp
    weights: WeightStore = field(default_factory=WeightStore)

    def __repr__(self) -> str:
        # The IR as text, not the dataclass repr of xDSL's object tree: hypothesis prints a
        # failing example's arguments, and that repr ran to 199 MB for a 30-op random graph.
        weights = ", ".join(f"{k} {tuple(np.shape(v))}" for k, v in self.weights.items()) or "none"
        try:
            return f"Model(weights: {weights})\n{self.text}"
        except Exception:  # noqa: BLE001 - a repr must not raise; IR mid-rewrite may not print
            return f"Model(weights: {weights}, IR not printable)"

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        # hypothesis pretty-prints dataclasses field by field unless told otherwise.
        printer.text(repr(self))

    def __post_init__(self) -> None:
        if not isinstance(self.weights, WeightStore):
            self.weights = WeightStore(self.weights)
        _WEIGHTS_OF[self.module] = self.weights

    @property
    def func(self) -> FuncOp:
        for op in self.module.ops:
            if isinstance(op, FuncOp) and op.sym_name.data == "forward":
                return op
        raise ModelError("the module has no func.func @forward")

    @property
    def input_names(self) -> list[str]:
        return [_name_of(self.func.arg_attrs, i, f"input{i}") for i in range(len(self.func.args))]

    @property
    def output_names(self) -> list[str]:
        n = len(self.func.function_type.outputs.data)
        return [_name_of(self.func.res_attrs, i, f"output{i}") for i in range(n)]

    @property
    def inputs(self) -> list[TensorInfo]:
        return [info_of(a.type) for a in self.func.args]

    @property
    def outputs(self) -> list[TensorInfo]:
        return [info_of(t) for t in self.func.function_type.outputs.data]

    @property
    def aliases(self) -> dict[int, int]:
        """Donated inputs: input index -> the index of the result that is its buffer, updated in place."""
        from xdsl.dialects.builtin import IntegerAttr

        out = {}
        for i in range(len(self.func.args)):
            d = self.func.arg_attrs.data[i] if self.func.arg_attrs is not None else None
            alias = d.data.get(ALIAS_ATTR) if isinstance(d, DictionaryAttr) else None
            if isinstance(alias, IntegerAttr):
                out[i] = alias.value.data
        return out

    def ops(self) -> list[Operation]:
        return [op for op in self.func.body.block.ops]

    @property
    def text(self) -> str:
        return print_module(self.module)

    def verify(self) -> None:
        """Verify the IR and that every weight it names is in the store with its type."""
        try:
            self.module.verify()
        except VerifyException as e:
            raise ModelError(f"the IR does not verify: {e}") from None
        missing = []
        for op in self.func.walk():
            if isinstance(op, TgOp) and op.op_name == Op.weight:
                name = op.attr("name")
                info = info_of(op.results[0].type)
                if name not in self.weights:
                    missing.append(name)
                    continue
                w = self.weights[name]
                if tuple(w.shape) != info.shape or dtypes.dtype_name(w.dtype) != info.dtype:
                    raise ModelError(
                        f"weight '{name}' is {dtypes.dtype_name(w.dtype)}{tuple(w.shape)} in the store "
                        f"but {info} in the IR"
                    )
        if missing:
            raise ModelError("weights missing from the store: " + ", ".join(sorted(missing)))
        outputs = self.outputs
        for i, r in self.aliases.items():
            if not 0 <= r < len(outputs) or outputs[r] != self.inputs[i]:
                raise ModelError(f"input {self.input_names[i]} is donated to result {r}, which is "
                                 f"{outputs[r] if 0 <= r < len(outputs) else 'not a result'}, not {self.inputs[i]}")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.text)
        self.weights.save(weights_path(path))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Model":
        path = Path(path)
        if not path.is_file():
            raise ModelError(f"no such file: {path}")
        module = parse_module(read_text(path), str(path))
        wpath = weights_path(path)
        weights = WeightStore.load(wpath) if wpath.is_file() else WeightStore()
        model = cls(module, weights)
        model.verify()
        return model

    @classmethod
    def parse(cls, text: str, weights: dict | None = None) -> "Model":
        return cls(parse_module(text), WeightStore(weights or {}))

    def clone(self) -> "Model":
        return Model(self.module.clone(), WeightStore(self.weights))


def _name_of(attrs, i: int, default: str) -> str:
    if attrs is None:
        return default
    d = attrs.data[i]
    if isinstance(d, DictionaryAttr) and NAME_ATTR in d.data:
        v = d.data[NAME_ATTR]
        if isinstance(v, StringAttr):
            return v.data
    return default


_SSA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$.]*$")


def ssa_hint(name: str) -> str | None:
    """A name usable as an SSA name hint, or None (xDSL rejects some names)."""
    hint = re.sub(r"[^A-Za-z0-9_]", "_", name)
    if not hint or hint[0].isdigit() or not _SSA_NAME.match(hint):
        hint = "v_" + hint
    return hint if not re.fullmatch(r"_?\d+", hint) else None
