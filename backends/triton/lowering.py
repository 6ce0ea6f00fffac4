"""The Triton backend's lowering table (backends/lowering.py) and its per-op templates.

Every op of the table is lowered one of three ways:
- a kernel or a torch call: elementwise ops from `TRITON` / `TRITON_INT` below in row
  kernels (backends/triton/group_kernels.py), reductions and scans as row kernels, matmul /
  conv / attention / gather as their own kernels, quantization ops in
  backends/triton/quant.py, layout ops as torch calls (`TORCH_LAYOUT`, `split`, `slice`
  in emit.py), `iota` as torch.arange, sources as inputs;
- decomposed (`DECOMPOSED`): spelled out by the decomposition library before kernels
  are written (attention keeps its own kernel);
- on the host (`HOST`): the op's NumPy template on host copies, named in the emitted
  module's HOST_OPS. An op whose kernel refuses a particular case (a conv that is not
  2-D, a slice with a negative step) falls back the same way.
"""

from __future__ import annotations

from tilegraph.ir.ops import OPS
from tilegraph.backends.lowering import table

# The Triton expression of each elementwise op, for the Triton backend's kernels
# (backends/triton/group_kernels.py). Operands are Triton tensors: floats computed in fp32
# (fp64 for f64), ints and bools in their own type; `{dtype}` is the result's compute
# type, `{storage}` its storage type. The NumPy templates stay the semantics these
# must match; `tlmath` holds what Triton's interpreter lacks (backends/triton/tlmath.py).
_NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"  # np.maximum/np.minimum propagate nan
TRITON: dict[str, str] = {
    "neg": "-{x}", "abs": "tl.abs({x})", "exp": "tl.exp({x})", "log": "tl.log({x})", "sqrt": "tl.sqrt({x})",
    "rsqrt": "1.0 / tl.sqrt({x})", "reciprocal": "1.0 / {x}", "tanh": "tlmath.tanh({x})",
    "sigmoid": "tlmath.sigmoid({x})", "relu": f"tl.maximum({{x}}, 0.0, {_NAN_ALL})", "erf": "tl.math.erf({x})",
    "sin": "tl.sin({x})", "cos": "tl.cos({x})", "tan": "tl.sin({x}) / tl.cos({x})", "asin": "tlmath.asin({x})",
    "acos": "tlmath.acos({x})", "atan": "tlmath.atan({x})", "sinh": "tlmath.sinh({x})", "cosh": "tlmath.cosh({x})",
    "asinh": "tlmath.asinh({x})", "acosh": "tlmath.acosh({x})", "atanh": "tlmath.atanh({x})",
    "floor": "tl.floor({x})", "ceil": "tl.ceil({x})", "round": "tlmath.rint({x})", "sign": "tlmath.sign({x})",
    "bitwise_not": "~{x}", "not": "{x} == 0", "isnan": "{x} != {x}",
    "isinf": "(({x} == float('inf')) & {detect_positive}) | (({x} == float('-inf')) & {detect_negative})",
    "cast": "{x}.to({storage}).to({dtype})",
    "add": "{lhs} + {rhs}", "sub": "{lhs} - {rhs}", "mul": "{lhs} * {rhs}", "div": "{lhs} / {rhs}",
    "pow": "tlmath.pow({lhs}, {rhs})", "max": f"tl.maximum({{lhs}}, {{rhs}}, {_NAN_ALL})",
    "min": f"tl.minimum({{lhs}}, {{rhs}}, {_NAN_ALL})", "bitwise_and": "{lhs} & {rhs}",
    "bitwise_or": "{lhs} | {rhs}", "bitwise_xor": "{lhs} ^ {rhs}", "shift_left": "{lhs} << {rhs}",
    "shift_right": "{lhs} >> {rhs}", "mod": "tlmath.mod({lhs}, {rhs}, {fmod})",
    "and": "({lhs} != 0) & ({rhs} != 0)", "or": "({lhs} != 0) | ({rhs} != 0)", "xor": "({lhs} != 0) ^ ({rhs} != 0)",
    "eq": "{lhs} == {rhs}", "ne": "{lhs} != {rhs}", "lt": "{lhs} < {rhs}", "le": "{lhs} <= {rhs}",
    "gt": "{lhs} > {rhs}", "ge": "{lhs} >= {rhs}", "where": "tl.where({cond}, {lhs}, {rhs})",
    "expm1": "tlmath.expm1({x})", "log1p": "tlmath.log1p({x})",
}
# Where the integer (and bool) form differs: `//` truncates toward zero as K.div does.
TRITON_INT: dict[str, str] = {
    "relu": "tl.maximum({x}, 0)", "floor": "{x}", "ceil": "{x}", "round": "{x}",
    "sign": "tl.where({x} > 0, 1, tl.where({x} < 0, -1, 0)).to({dtype})", "div": "{lhs} // {rhs}",
    "pow": "tlmath.ipow({lhs}, {rhs})", "max": "tl.maximum({lhs}, {rhs})", "min": "tl.minimum({lhs}, {rhs})",
    "isnan": "{x} != {x}", "abs": "tl.abs({x})",
}

# Layout ops as torch calls (views where torch can).
TORCH_LAYOUT = {
    "reshape": "{x}.reshape({out_shape})",
    "broadcast": "{x}.expand({out_shape})",
    "transpose": "{x}.permute({perm})",
    "concat": "torch.cat({inputs}, dim={axis})",
}
# Composites spelled out before kernels are written (attention keeps its own kernel).
DECOMPOSED = ("softmax", "layer_norm", "gelu")
_HOST = "no kernel: its NumPy template runs on host copies (HOST_OPS)"
HOST = {name: _HOST for name in ("einsum", "max_pool", "avg_pool", "gather_elements", "pad", "tile", "bitcast",
                                 "scatter_elements", "scatter_nd", "topk", "nonzero", "unique", "narrow",
                                 "non_max_suppression", "rnn", "assert_size",
                                 # generation's ops have kernels in the C backend only so far
                                 "block_matmul", "block_gather", "cache_write", "cache_attention",
                                 "rms_norm", "rope", "sample", "dropout",
                                 # attention's backward: the C backend's kernel only so far
                                 "attention_grad")}
KERNELS = ("trilu", "argmax", "argmin", "cumsum", "cumprod", "matmul", "conv", "attention", "gather",
           "quantize", "dequantize", "dynamic_quantize", "matmul_integer")
TORCH_CALLS = (*TORCH_LAYOUT, "split", "slice", "iota", "constant", "weight")

LOWERINGS = table(template=[*TRITON, *(n for n, s in OPS.items() if s.reduction), *KERNELS, *TORCH_CALLS],
                  decompose=DECOMPOSED, fallback=HOST)
