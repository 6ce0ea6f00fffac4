"""Reverse-mode autodiff as a transformation of tg IR into tg IR (JAX's `grad`, on our functions).

    m = vjp(model, wrt=["fc.w"])          # @forward(inputs..., cotangent per float output) ->
                                          #   (outputs..., d<wrt> for each wrt)
    m = value_and_grad(model)             # the first output a scalar loss: (outputs..., grads of every float weight)
    m = grad(model)                       # the grads only

The result is an ordinary `ir.Model`: every pass and backend applies to the backward as to
the forward. The walk goes over the ops between what is differentiated against and the
outputs, last to first, calling each op's rule from `ir/vjp.py` and summing the cotangents
of values used more than once. Differentiating against a weight means against every
`tg.weight` op of that name (a weight read twice gets both reads' cotangents).
"""

from __future__ import annotations

from typing import Sequence

from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, FunctionType, IntegerAttr, StringAttr
from xdsl.dialects.func import ReturnOp
from xdsl.ir import SSAValue

from tilegraph.ir import dtypes
from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir.model import ALIAS_ATTR, NAME_ATTR, Model, ModelError, ssa_hint
from tilegraph.ir.shapes import TensorInfo, info_of, tensor_type
from tilegraph.ir.vjp import NO_GRADIENT, VJPS, Backward
from tilegraph.ir.ops import Op


class NotDifferentiable(ModelError):
    """An op on the path from an output to what is differentiated against has no VJP."""


def float_weights(model: Model) -> list[str]:
    """The names of the model's float weights, in the order the function first reads them."""
    names = []
    for op in model.func.body.block.ops:
        if isinstance(op, TgOp) and op.op_name == Op.weight and dtypes.is_float(info_of(op.results[0].type).dtype):
            if op.attr("name") not in names:
                names.append(op.attr("name"))
    return names


def _sources(model: Model, wrt: Sequence[str] | None) -> tuple[list[str], dict[str, list[SSAValue]]]:
    """wrt names -> the SSA values standing for each (an input's argument; a weight's reads)."""
    block = model.func.body.block
    inputs = dict(zip(model.input_names, block.args))
    reads: dict[str, list[SSAValue]] = {}
    for op in block.ops:
        if isinstance(op, TgOp) and op.op_name == Op.weight:
            reads.setdefault(op.attr("name"), []).append(op.results[0])
    names = float_weights(model) if wrt is None else list(wrt)
    out = {}
    for name in names:
        if name in inputs and name in reads:
            raise ModelError(f"'{name}' names both an input and a weight: differentiate against one of them")
        values: list[SSAValue] | None = [inputs[name]] if name in inputs else reads.get(name)
        if values is None:
            if name in model.weights:  # a weight the function never reads: its gradient is zero
                values = []
            else:
                raise ModelError(f"cannot differentiate against '{name}': no input or weight has that name "
                                 f"(inputs: {', '.join(inputs) or 'none'}; weights: "
                                 f"{', '.join(float_weights(model)) or 'none'})")
        for v in values:
            if not dtypes.is_float(info_of(v.type).dtype):
                raise ModelError(f"cannot differentiate against '{name}': it is {info_of(v.type)}, not a float")
        out[name] = values
    return names, out


def _transform(model: Model, wrt, seeds: str, keep_outputs: bool) -> Model:
    model = model.clone()
    func = model.func
    block = func.body.block
    ret = block.last_op
    assert isinstance(ret, ReturnOp)
    if any(isinstance(op, FusionOp) for op in block.ops):
        raise ModelError("autodiff runs on tg ops, before fusion: differentiate the model before `fuse`")
    names, sources = _sources(model, wrt)
    outputs = list(ret.operands)
    out_names, in_names = model.output_names, model.input_names
    b = Backward()
    # The cotangent of each output: a new input per float output (vjp), or 1 for a scalar loss (grad).
    cot: dict[SSAValue, SSAValue] = {}
    new_inputs: list[tuple[str, SSAValue]] = []
    if seeds == "inputs":
        for name, v in zip(out_names, outputs):
            t = info_of(v.type)
            if dtypes.is_float(t.dtype):
                arg = block.insert_arg(tensor_type(t.dtype, t.shape), len(block.args))
                arg.name_hint = ssa_hint("cotangent_" + name)
                new_inputs.append(("cotangent_" + name, arg))
                _accumulate(b, cot, v, arg)
    else:
        loss = outputs[0]
        t = info_of(loss.type)
        if t.rank != 0 or not dtypes.is_float(t.dtype):
            raise ModelError(f"grad differentiates a scalar float loss (the first output), not {t}")
        cot[loss] = b.const(1.0, t.dtype)
    # The ops on a path from a source to an output.
    live = {v for values in sources.values() for v in values}
    forward = []
    for op in block.ops:
        if op is ret:
            break
        if any(v in live for v in op.operands):
            live.update(op.results)
            forward.append(op)
    for op in reversed(forward):
        gs = [cot.get(r) for r in op.results]
        if all(g is None for g in gs):
            continue
        rule = VJPS.get(op.op_name)
        if rule is None:
            # a cotangent reached an op a differentiated value flows into: the path is cut here
            reason = NO_GRADIENT.get(op.op_name, "no VJP is declared in ir/vjp.py")
            raise NotDifferentiable(f"cannot differentiate through tg.{op.op_name}: {reason}")
        try:
            grads = rule(b, op, gs)
        except NotImplementedError as e:
            raise NotDifferentiable(f"cannot differentiate through tg.{op.op_name}: {e}") from None
        for v, g in zip(op.operands, grads):
            if g is not None and v in live and dtypes.is_float(info_of(v.type).dtype):
                _accumulate(b, cot, v, g)
    results: list[SSAValue] = []
    for name in names:
        total = None
        for v in sources[name]:
            if v in cot:
                total = cot[v] if total is None else b("add", total, cot[v])
        if total is None:
            t = info_of(sources[name][0].type) if sources[name] else _weight_info(model, name)
            total = b.zeros(t)
        results.append(total)
    block.insert_ops_before(b.ops, ret)
    values = (outputs if keep_outputs else []) + results
    result_names = (out_names if keep_outputs else []) + ["grad_" + n for n in names]
    return set_signature(model, in_names + [n for n, _ in new_inputs], values, result_names)


def set_signature(model: Model, input_names: Sequence[str], values: Sequence[SSAValue], names: Sequence[str],
                  aliases: dict[str, str] | None = None) -> Model:
    """`model` returning `values` named `names`, its arguments named `input_names`; `aliases`
    maps an input name to the result name that is its buffer (Model.aliases: a donated input,
    updated in place). Verified."""
    func = model.func
    block = func.body.block
    ret = block.last_op
    block.insert_op_before(ReturnOp(*values), ret)
    block.erase_op(ret)
    aliases = aliases or {}
    func.function_type = FunctionType.from_lists([a.type for a in block.args], [v.type for v in values])
    func.arg_attrs = ArrayAttr([DictionaryAttr({NAME_ATTR: StringAttr(n), **(
        {ALIAS_ATTR: IntegerAttr(list(names).index(aliases[n]), 64)} if n in aliases else {})}) for n in input_names])
    func.res_attrs = ArrayAttr([DictionaryAttr({NAME_ATTR: StringAttr(n)}) for n in names])
    model.verify()
    return model


def _weight_info(model: Model, name: str) -> TensorInfo:
    w = model.weights[name]
    return TensorInfo(tuple(w.shape), dtypes.dtype_name(w.dtype))


def _accumulate(b: Backward, cot: dict, v: SSAValue, g: SSAValue) -> None:
    t = info_of(v.type)
    if info_of(g.type).dtype != t.dtype:
        g = b("cast", g, to=t.dtype)
    if tuple(info_of(g.type).shape) != tuple(t.shape):
        g = b.sum_to(g, t.shape) if info_of(g.type).rank >= t.rank else b.broadcast_to(g, t.shape)
    cot[v] = g if v not in cot else b("add", cot[v], g)


def vjp(model: Model, wrt: Sequence[str] | None = None) -> Model:
    """@forward(inputs..., cotangent_<output> for each float output) -> (outputs..., grad_<wrt>...):
    the vector-Jacobian product of the whole function. wrt: input and weight names (default:
    every float weight)."""
    return _transform(model, wrt, "inputs", keep_outputs=True)


def value_and_grad(model: Model, wrt: Sequence[str] | None = None) -> Model:
    """The first output a scalar loss: @forward(inputs...) -> (outputs..., grad_<wrt>...)."""
    return _transform(model, wrt, "one", keep_outputs=True)


def grad(model: Model, wrt: Sequence[str] | None = None) -> Model:
    """The first output a scalar loss: @forward(inputs...) -> (grad_<wrt>...)."""
    return _transform(model, wrt, "one", keep_outputs=False)
