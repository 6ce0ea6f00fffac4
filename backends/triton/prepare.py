"""The Triton backend's preparation pipeline: the IR rewrites it needs before it writes kernels,
as passes its description (backends/__init__.py) names in order; `import tilegraph` registers
them, so that `tilegraph-opt -p triton-quantized-groups,triton-kernel-groups` shows them and
the property suite checks each against the float64 interpreter.

- `triton-quantized-groups`: each quantized GEMM's dequantize prologues and epilogue in one
  tg.fusion group, which `quant.QuantKernelWriter` writes as one GEMM (quant.py says why).
- `triton-kernel-groups`: every op that computes sits in a tg.fusion group (one kernel each),
  and the composites this backend has no kernel for (lowering.py's DECOMPOSED) are spelled
  out inside their groups by the decomposition library.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.dialects.func import FuncOp
from xdsl.ir import Block
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from tilegraph.backends.triton.lowering import DECOMPOSED
from tilegraph.backends.triton.quant import group_quantized
from tilegraph.ir.decompositions import expand
from tilegraph.ir.dialect import FusionOp, TgOp, YieldOp
from tilegraph.ir.model import Model, context
from tilegraph.ir.ops import Op

@dataclass(frozen=True)
class QuantizedGroups(ModulePass):
    name = "triton-quantized-groups"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for func in op.ops:
            if isinstance(func, FuncOp):
                group_quantized(func)


@dataclass(frozen=True)
class KernelGroups(ModulePass):
    name = "triton-kernel-groups"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        rewriter = Rewriter()
        for inner in list(op.walk()):
            if isinstance(inner, TgOp) and _kernel_op(inner) and not isinstance(inner.parent_op(), FusionOp):
                _wrap(inner, rewriter)
        for group in [g for g in op.walk() if isinstance(g, FusionOp)]:
            for inner in [o for o in group.ops if o.op_name in DECOMPOSED]:
                expand(inner)


def prepare(model: Model) -> Model:
    """A copy of the model where every compute op sits in a tg.fusion group and groups hold
    no composites but attention."""
    from tilegraph.backends import BACKENDS, attribute

    module = model.module.clone()
    for _, path in BACKENDS["triton"].passes:
        attribute(path)().apply(context(), module)
    return Model(module, model.weights)


def _kernel_op(op: TgOp) -> bool:
    """Ops that compute (and so get a kernel): everything but sources and views."""
    return (op.SPEC.category not in ("source", "layout") or op.op_name == Op.gather) and op.SPEC.bound is None


def in_block(op: TgOp) -> tuple[Block, TgOp]:
    """A copy of op in a block of its own, reading the block's arguments."""
    block = Block(arg_types=[v.type for v in op.operands])
    inner = op.clone()
    for i, arg in enumerate(block.args):
        inner.operands[i] = arg
    block.add_op(inner)
    return block, inner


def _wrap(op: TgOp, rewriter: Rewriter) -> None:
    """Put a lone op into a tg.fusion group of its own."""
    block, inner = in_block(op)
    block.add_op(YieldOp.create(operands=list(inner.results)))
    group = FusionOp.build_group(op.op_name, list(op.operands), [r.type for r in op.results], block)
    rewriter.replace_op(op, group, list(group.results))
