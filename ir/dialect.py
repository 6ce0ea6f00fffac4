"""The `tg` dialect: xDSL op classes generated from the op table in `ir.ops`.

Every tg op has the same textual form, operands then attributes then result types:

    %2 = tg.add %0, %1 : tensor<?x384xf32, ["B"]>
    %3 = tg.reduce_sum %2 {axes = array<i64: 1>, keepdims = true} : tensor<?x1xf32, ["B"]>
    %w = tg.weight {name = "fc.weight"} : tensor<384x10xf32>

Operand types are not repeated: they are the types of the values named. The
verifier re-runs the op's shape rule and names the op and shapes when it fails.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import numpy as np
from xdsl.dialects.builtin import (
    BoolAttr,
    DenseArrayBase,
    DenseIntOrFPElementsAttr,
    ArrayAttr,
    DictionaryAttr,
    FloatAttr,
    IntegerAttr,
    IntegerType,
    StringAttr,
    TensorType,
    f64,
    i64,
)
from xdsl.ir import Attribute, Block, Dialect, Region, SSAValue
from xdsl.irdl import IRDLOperation, irdl_op_definition, region_def, traits_def, var_operand_def, var_result_def
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.traits import IsolatedFromAbove, IsTerminator, Pure
from xdsl.utils.exceptions import VerifyException

from tilegraph.ir import dtypes
from tilegraph.ir.ops import OPS, REQUIRED, OpSpec, infer, normalize_attrs
from tilegraph.ir.shapes import ShapeError, TensorInfo, info_of, tensor_type


def attr_to_py(attr: Attribute, kind: str) -> Any:
    if kind == "dense":
        return dense_to_numpy(attr)  # type: ignore[arg-type]
    if kind in ("ints", "floats"):
        if not isinstance(attr, DenseArrayBase):
            raise VerifyException(f"expected array<...>, got {attr}")
        return tuple(attr.get_values())
    if kind == "str":
        if not isinstance(attr, StringAttr):
            raise VerifyException(f"expected a string, got {attr}")
        return attr.data
    if kind == "bool":
        if not (isinstance(attr, IntegerAttr) and attr.type == IntegerType(1)):
            raise VerifyException(f"expected true/false, got {attr}")
        return bool(attr.value.data)
    if kind == "int":
        if not isinstance(attr, IntegerAttr):
            raise VerifyException(f"expected an integer, got {attr}")
        return int(attr.value.data)
    if kind == "float":
        if not isinstance(attr, (FloatAttr, IntegerAttr)):
            raise VerifyException(f"expected a float, got {attr}")
        return float(attr.value.data)
    raise AssertionError(kind)


def py_to_attr(value: Any, kind: str, result: TensorInfo | None = None) -> Attribute:
    if kind == "dense":
        return numpy_to_dense(np.asarray(value), result)
    if kind == "ints":
        return DenseArrayBase.from_list(i64, [int(v) for v in value])
    if kind == "floats":
        return DenseArrayBase.from_list(f64, [float(v) for v in value])
    if kind == "str":
        return StringAttr(str(value))
    if kind == "bool":
        return BoolAttr.from_bool(bool(value))
    if kind == "int":
        return IntegerAttr(int(value), i64)
    if kind == "float":
        return FloatAttr(float(value), f64)
    raise AssertionError(kind)


def numpy_to_dense(array: np.ndarray, info: TensorInfo | None = None) -> DenseIntOrFPElementsAttr:
    name = info.dtype if info else dtypes.dtype_name(array.dtype)
    t = tensor_type(name, array.shape)
    flat = array.reshape(-1)
    if dtypes.is_float(name):
        return DenseIntOrFPElementsAttr.from_list(t, [float(v) for v in flat.astype(np.float64)])  # type: ignore[return-value]
    return DenseIntOrFPElementsAttr.from_list(t, [int(v) for v in flat.astype(np.int64)])  # type: ignore[return-value]


def dense_to_numpy(attr: Attribute) -> np.ndarray:
    if not isinstance(attr, DenseIntOrFPElementsAttr):
        raise VerifyException(f"expected dense<...>, got {attr}")
    info = info_of(attr.type)
    values = attr.get_values()
    return np.asarray(values, dtype=np.float64 if dtypes.is_float(info.dtype) else np.int64).astype(
        dtypes.numpy_dtype(info.dtype)
    ).reshape(info.shape)


class TgOp(IRDLOperation):
    """Base of every tg op; `SPEC` is its row in the op table."""

    SPEC: ClassVar[OpSpec]

    inputs = var_operand_def(TensorType)
    outputs = var_result_def(TensorType)
    # --- passes: every tg op is a pure function of its operands (weights are
    # read-only), so xDSL's CSE and DCE may merge and drop them.
    traits = traits_def(Pure())

    @property
    def spec(self) -> OpSpec:
        return self.SPEC

    @property
    def op_name(self) -> str:
        return self.SPEC.name

    def attr(self, name: str) -> Any:
        """The Python value of an attribute, default filled in."""
        kind, default = self.SPEC.attrs[name]
        if name in self.attributes:
            return attr_to_py(self.attributes[name], kind)
        return default

    def py_attrs(self) -> dict[str, Any]:
        return {name: self.attr(name) for name in self.SPEC.attrs}

    def result_infos(self) -> list[TensorInfo]:
        return [info_of(r.type) for r in self.results]

    def verify_(self) -> None:
        try:
            attrs = normalize_attrs(self.SPEC, {n: self.attr(n) for n in self.attributes if n in self.SPEC.attrs}
                                    | {n: None for n in self.attributes if n not in self.SPEC.attrs})
            ins = [info_of(v.type) for v in self.operands]
            given = self.result_infos()
            expected = infer(self.SPEC, ins, attrs, given)
        except (ShapeError, VerifyException, ValueError) as e:
            raise VerifyException(f"{self.name}: {e}".replace(f"{self.name}: {self.name}: ", f"{self.name}: ")) from None
        if expected != given:
            raise VerifyException(
                f"{self.name}: result types {', '.join(map(str, given))} differ from the inferred "
                f"{', '.join(map(str, expected))} for operands {', '.join(map(str, ins))}"
            )

    def print(self, printer: Printer) -> None:
        if self.operands:
            printer.print_string(" ")
            printer.print_list(self.operands, printer.print_operand)
        if not _print_nonfinite_constant(self, printer):
            printer.print_op_attributes(self.attributes)
        printer.print_string(" : ")
        printer.print_list([r.type for r in self.results], printer.print_attribute)

    @classmethod
    def parse(cls, parser: Parser) -> "TgOp":
        operands: list[SSAValue] = []
        first = parser.parse_optional_operand()
        if first is not None:
            operands.append(first)
            while parser.parse_optional_punctuation(",") is not None:
                operands.append(parser.parse_operand())
        attrs = parser.parse_optional_attr_dict()
        parser.parse_punctuation(":")
        types = parser.parse_comma_separated_list(parser.Delimiter.NONE, parser.parse_type)
        return cls.create(operands=operands, result_types=types, attributes=attrs)


# --- passes: inf/nan constants (softmax masks, folded results) ---------------
# xDSL prints a non-finite float element as a bare hex integer (0xff800000) that
# its own parser then reads back as the integer 4286578688. A dense attribute in
# the quoted raw-bytes form (dense<"0x0000807F">) parses back bit-exactly, so a
# constant holding inf or nan prints in that form.
def _print_nonfinite_constant(op: "TgOp", printer: Printer) -> bool:
    value = op.attributes.get("value")
    if op.name != "tg.constant" or set(op.attributes) != {"value"} or not isinstance(value, DenseIntOrFPElementsAttr):
        return False
    if not dtypes.is_float(info_of(value.type).dtype) or np.isfinite(dense_to_numpy(value).astype(np.float64)).all():
        return False
    printer.print_string(' {value = dense<"0x' + value.data.data.hex().upper() + '"> : ')
    printer.print_attribute(value.type)
    printer.print_string("}")
    return True


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_")) + "Op"


def _make_op_class(spec: OpSpec) -> type[TgOp]:
    cls = type(_class_name(spec.name), (TgOp,), {
        "name": "tg." + spec.name,
        "SPEC": spec,
        "__module__": __name__,
        "__doc__": spec.doc or f"tg.{spec.name}",
        "__annotations__": {"SPEC": ClassVar[OpSpec]},
    })
    return irdl_op_definition(cls)


OP_CLASSES: dict[str, type[TgOp]] = {name: _make_op_class(spec) for name, spec in OPS.items()}
globals().update({cls.__name__: cls for cls in OP_CLASSES.values()})



def make_op(name: str, operands: list[SSAValue], attrs: dict[str, Any] | None = None,
            result: TensorInfo | list[TensorInfo] | None = None) -> TgOp:
    """Create a tg op, running its shape rule; raises ShapeError naming the op."""
    spec = OPS[name]
    attrs = normalize_attrs(spec, attrs or {})
    given = [result] if isinstance(result, TensorInfo) else result
    ins = [info_of(v.type) for v in operands]
    results = infer(spec, ins, attrs, given)
    attributes = {
        k: py_to_attr(v, spec.attrs[k][0], results[0] if spec.attrs[k][0] == "dense" else None)
        for k, v in attrs.items()
        if not _is_default(spec, k, v)
    }
    return OP_CLASSES[name].create(operands=operands, result_types=[tensor_type(r.dtype, r.shape) for r in results],
                                   attributes=attributes)


def _is_default(spec: OpSpec, name: str, value: Any) -> bool:
    # Defaults stay out of the printed IR so that it shows only what was chosen.
    kind, default = spec.attrs[name]
    return kind != "dense" and default is not REQUIRED and value == default


# --- fusion groups (the fuse pass) --------------------------------------------
# A fused group is visible in the IR as one `tg.fusion` op whose region holds the
# fused ops; block arguments stand for the group's inputs, `tg.yield` names its
# results. Its kind (what the group is anchored on) and, after `tile`, its tile
# sizes are attributes:
#
#   %5 = tg.fusion "matmul_epilogue" (%x = %3, %w = %4, %b = %1) {tile = {...}} : tensor<?x384xf32, ["B"]> {
#     %6 = tg.matmul %x, %w : tensor<?x384xf32, ["B"]>
#     %7 = tg.add %6, %b : tensor<?x384xf32, ["B"]>
#     tg.yield %7
#   }


@irdl_op_definition
class YieldOp(IRDLOperation):
    """The terminator of a tg.fusion region: the group's results."""

    name = "tg.yield"
    values = var_operand_def(TensorType)
    traits = traits_def(IsTerminator())

    def print(self, printer: Printer) -> None:
        if self.operands:
            printer.print_string(" ")
            printer.print_list(self.operands, printer.print_operand)

    @classmethod
    def parse(cls, parser: Parser) -> "YieldOp":
        operands = parser.parse_optional_undelimited_comma_separated_list(parser.parse_optional_operand,
                                                                          parser.parse_operand) or []
        return cls.create(operands=operands)


@irdl_op_definition
class FusionOp(IRDLOperation):
    """A fused group: its region computes the results from the block arguments only."""

    name = "tg.fusion"
    inputs = var_operand_def(TensorType)
    outputs = var_result_def(TensorType)
    body = region_def("single_block")
    traits = traits_def(Pure(), IsolatedFromAbove())

    @staticmethod
    def build_group(kind: str, operands: Sequence[SSAValue], result_types: Sequence[Attribute], block: Block,
                    attributes: dict[str, Attribute] | None = None) -> "FusionOp":
        return FusionOp.create(operands=list(operands), result_types=list(result_types),
                               attributes={"kind": StringAttr(kind), **(attributes or {})}, regions=[Region(block)])

    @property
    def kind(self) -> str:
        kind = self.attributes.get("kind")
        return kind.data if isinstance(kind, StringAttr) else ""

    @property
    def block(self) -> Block:
        return self.body.blocks[0]

    @property
    def ops(self) -> list[TgOp]:
        """The fused ops, in order (the terminator left out)."""
        return [op for op in self.block.ops if isinstance(op, TgOp)]

    def tile(self) -> dict[str, Any]:
        """The tile sizes the `tile` pass chose (empty before it ran)."""
        tile = self.attributes.get("tile")
        if not isinstance(tile, DictionaryAttr):
            return {}
        def value(v: Attribute) -> Any:
            if isinstance(v, IntegerAttr):
                return v.value.data
            if isinstance(v, ArrayAttr):  # the autotuner's candidate configurations
                return [value(x) for x in v.data]
            if isinstance(v, DictionaryAttr):
                return {k: value(x) for k, x in v.data.items()}
            return v

        if not _all_integers(tile):
            raise VerifyException(f"tg.fusion: its tile must hold integers, got {tile}")
        return {k: value(v) for k, v in tile.data.items()}

    def verify_(self) -> None:
        if not isinstance(self.attributes.get("kind"), StringAttr):
            raise VerifyException("tg.fusion: needs a string `kind`")
        block = self.body.blocks[0] if self.body.blocks else None
        if block is None or not isinstance(block.last_op, YieldOp):
            raise VerifyException("tg.fusion: its region must end in tg.yield")
        if [a.type for a in block.args] != [v.type for v in self.operands]:
            raise VerifyException("tg.fusion: block argument types "
                                  f"{', '.join(str(a.type) for a in block.args)} differ from its operand types "
                                  f"{', '.join(str(v.type) for v in self.operands)}")
        yielded = [v.type for v in block.last_op.operands]
        if yielded != [r.type for r in self.results]:
            raise VerifyException(f"tg.fusion: yields {', '.join(map(str, yielded))} but its results are "
                                  f"{', '.join(str(r.type) for r in self.results)}")
        for op in block.ops:
            if not isinstance(op, (TgOp, YieldOp)):
                raise VerifyException(f"tg.fusion: {op.name} cannot be fused; a group holds tg ops only")
        if any(v in block.args for v in block.last_op.operands):  # backends write results into buffers of their own
            raise VerifyException("tg.fusion: yields one of its arguments unchanged; a group yields what its ops compute")
        tile = self.attributes.get("tile")
        if tile is not None and not _all_integers(tile):
            # Backends write tile sizes into generated code: integers only, whatever a file says.
            raise VerifyException(f"tg.fusion: its tile must hold integers (and arrays and dicts of them), got {tile}")

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        printer.print_string_literal(self.kind)
        printer.print_string(" (")
        printer.print_list(zip(self.block.args, self.operands), lambda pair: _print_binding(printer, *pair))
        printer.print_string(")")
        printer.print_op_attributes({k: v for k, v in self.attributes.items() if k != "kind"})
        printer.print_string(" : ")
        printer.print_list([r.type for r in self.results], printer.print_attribute)
        printer.print_string(" ")
        printer.print_region(self.body, print_entry_block_args=False)

    @classmethod
    def parse(cls, parser: Parser) -> "FusionOp":
        kind = parser.parse_str_literal()
        args, operands = [], []

        def binding():
            arg = parser.parse_argument(expect_type=False)
            parser.parse_punctuation("=")
            operand = parser.parse_operand()
            args.append(arg.resolve(operand.type))
            operands.append(operand)

        parser.parse_comma_separated_list(parser.Delimiter.PAREN, binding)
        attrs = parser.parse_optional_attr_dict()
        parser.parse_punctuation(":")
        types = parser.parse_comma_separated_list(parser.Delimiter.NONE, parser.parse_type)
        region = parser.parse_region(args)
        return cls.create(operands=operands, result_types=types, attributes={"kind": StringAttr(kind), **attrs},
                          regions=[region])


def _all_integers(attr: Attribute) -> bool:
    if isinstance(attr, IntegerAttr):
        return True
    if isinstance(attr, ArrayAttr):
        return all(_all_integers(a) for a in attr.data)
    if isinstance(attr, DictionaryAttr):
        return all(_all_integers(a) for a in attr.data.values())
    return False


def _print_binding(printer: Printer, arg: SSAValue, value: SSAValue) -> None:
    printer.print_block_argument(arg, print_type=False)  # type: ignore[arg-type]
    printer.print_string(" = ")
    printer.print_operand(value)


TG = Dialect("tg", [*OP_CLASSES.values(), FusionOp, YieldOp], [])
