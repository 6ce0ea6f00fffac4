"""The reference interpreter: runs any tg model in NumPy, floats in float64.

It is the semantics oracle of every test. It renders each op's NumPy template
from the op table (`ir.ops`) — the same description the NumPy backend emits — and
evaluates it with float tensors widened to float64, one op at a time, with no
fusion, no buffer reuse and no cleverness.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping, Sequence

import ml_dtypes
import numpy as np
from xdsl.ir import OpResult

from tilegraph.ir import dtypes, kernels
from tilegraph.ir.dialect import FusionOp, TgOp
from tilegraph.ir.model import Model, ModelError
from tilegraph.ir.ops import Op, render, size_definitions
from tilegraph.ir.signature import SHAPE_FUNCTIONS, Signature
from tilegraph.ir.shapes import Dim


def dtype_code(name: str, float64: bool = False) -> str:
    """Python source naming the NumPy dtype of an element type."""
    if float64 and dtypes.is_float(name):
        return "np.float64"
    dt = dtypes.numpy_dtype(name)
    if dt.type.__module__ == "numpy":
        return f"np.{dt.type.__name__}"
    return f"ml_dtypes.{dt.name}"


def shape_code(shape: Sequence[Dim]) -> str:
    # (ONNX frontend) A dim with a division (6*S/floor(3*S/2), from a reshape's -1) is an
    # integer that Python's / computes as a float: int() it back.
    parts = [f"int({d})" if "/" in str(d) else str(d) for d in shape]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


GLOBALS = {"np": np, "K": kernels, "ml_dtypes": ml_dtypes, **SHAPE_FUNCTIONS}


def evaluate_rendered(expr: str, local: dict[str, Any]) -> Any:
    """An op's rendered template (ops.render) evaluated on the values `local` names."""
    return eval(expr, dict(GLOBALS), local)


@lru_cache(maxsize=4096)
def _compile(expr: str):
    return compile(expr, "<tg op>", "eval")


def bind_inputs(model: Model, inputs: Sequence[Any] | Mapping[str, Any]) -> tuple[list[np.ndarray], dict[str, int]]:
    """Check inputs against the signature; returns arrays in declared dtypes and symbol values."""
    return Signature.of(model).bind(inputs)


def interpret(model: Model, inputs: Sequence[Any] | Mapping[str, Any], float64: bool = True,
              values: dict | None = None) -> list[np.ndarray]:
    """Run @forward; floats are computed (and returned) in float64 unless float64=False.
    `values`, when given, receives every SSA value's array (calibration, bound checks)."""
    arrays, sizes = bind_inputs(model, inputs)
    widen = (lambda a: a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name in ("bfloat16",) or
             dtypes.is_float(dtypes.dtype_name(a.dtype)) else a) if float64 else (lambda a: a)
    env: dict[Any, Any] = values if values is not None else {}
    for arg, a in zip(model.func.args, arrays):
        env[arg] = widen(a)
    glob = {**GLOBALS, **sizes}
    results = _run_block(model.func.body.block, env, model.weights, glob, float64, widen)
    if results is None:
        raise ModelError("@forward has no func.return")
    return [np.asarray(v) for v in results]


def _run_block(block, env: dict, weights, glob: dict, float64: bool, widen) -> list[Any] | None:
    """Run a block's ops; returns the values its terminator (func.return, tg.yield) names."""
    for op in block.ops:
        if op.name in ("func.return", "tg.yield"):
            return [env[v] for v in op.operands]
        if op.name == "shard.sharding":  # a sharding annotation's spec: no value to compute
            continue
        if op.name == "shard.shard":  # an annotation says where a value lives, not what it is
            env[op.results[0]] = env[op.operands[0]]
            continue
        if isinstance(op, FusionOp):  # a fused group means what its ops mean, one at a time
            env.update(zip(op.block.args, (env[v] for v in op.operands)))
            results = _run_block(op.block, env, weights, glob, float64, widen)
        elif isinstance(op, TgOp):
            results = evaluate(op, [env[v] for v in op.operands], weights, glob, float64, widen)
        else:
            raise ModelError(f"the interpreter cannot run {op.name}")
        env.update(zip(op.results, results))  # type: ignore[arg-type]
        bind_sizes(op, results, glob)
    return None


def bind_sizes(op, results: Sequence[Any], sizes: dict) -> None:
    """Bind the run-time dims an op defines (tg.nonzero's count...) from its results' shapes."""
    for i, axis, name in size_definitions(op):
        sizes[name] = int(np.shape(results[i])[axis])


def evaluate(op: TgOp, operands: list[Any], weights: Mapping[str, np.ndarray], glob: dict, float64: bool,
             widen=lambda a: a) -> list[Any]:
    """One op on concrete arrays."""
    name = op.op_name
    if name == Op.weight:
        return [widen(np.asarray(weights[op.attr("name")]))]
    if name == Op.constant:
        return [widen(op.attr("value"))]
    outs = op.result_infos()
    local = {f"a{i}": v for i, v in enumerate(operands)}
    expr = render(op.SPEC, list(local), op.py_attrs(), shape_code(outs[0].shape), dtype_code(outs[0].dtype, float64))
    with np.errstate(all="ignore"):
        value = eval(_compile(expr), glob, local)
    return list(value) if len(outs) > 1 else [value]


def run_time_sizes(model: Model, arrays: Sequence[np.ndarray], sizes: dict[str, int]) -> tuple[dict[str, int], dict]:
    """For a backend that plans its memory per binding of the sizes (C): the dims known only
    at run time, found by running (in the model's dtypes) just the ops that the ops defining
    them depend on. Returns all sizes, and each defining op's results, for the backend to use
    as that op's results (so its shapes are the ones planned for)."""
    block = model.func.body.block
    wanted = [op for op in block.ops if size_definitions(op)]
    needed: set = set()
    stack = list(wanted)
    while stack:
        op = stack.pop()
        if op in needed:
            continue
        needed.add(op)
        stack += [v.owner for v in op.operands if isinstance(v, OpResult) and v.owner.parent_block() is block]
    env: dict[Any, Any] = dict(zip(model.func.args, arrays))
    glob = {**GLOBALS, **sizes}
    known = {}
    for op in block.ops:
        if op not in needed:
            continue
        if isinstance(op, FusionOp):
            env.update(zip(op.block.args, (env[v] for v in op.operands)))
            results = _run_block(op.block, env, model.weights, glob, False, lambda a: a)
        else:
            results = evaluate(op, [env[v] for v in op.operands], model.weights, glob, False)
        env.update(zip(op.results, results))
        if size_definitions(op):
            known[op] = results
        bind_sizes(op, results, glob)
    return {**sizes, **{name: glob[name] for op in wanted for _, _, name in size_definitions(op)}}, known  # type: ignore[misc]
