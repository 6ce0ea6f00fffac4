"""ONNX -> tg: `from_onnx(path_or_proto)` maps an ONNX graph onto the tg dialect.

What it decides and how:

* Loading. A path or a `ModelProto`; a missing file or bytes that are not an ONNX
  model are a `FrontendError`, never a protobuf traceback.
* Checking first. One pass over all nodes collects every op it cannot convert
  (unknown op types, other domains, opset < 13 definitions that changed since) and
  raises ONE `FrontendError` listing them all, with counts and a node name each,
  before anything is converted.
* Values. Every ONNX value is either a tg `Tensor` (computed at run time) or a
  NumPy array known at import time: initializers, `Constant` nodes, `constant_inputs`,
  and whatever is computed from known values only. An op whose operands are all
  known is folded by evaluating that op's own NumPy template from `ir.ops` (the
  semantics live there, once), so the Shape -> Gather -> Unsqueeze -> Concat ->
  Reshape chains of exported models fold away. `Shape` of a symbolic dim gives an
  object array holding the sympy expression, so a Reshape target may be symbolic.
  A known value reaches the IR only where a tensor op needs it: as `tg.constant`
  when small, else as `tg.weight` under its ONNX name (initializers keep theirs).
* Ops. `CONVERTERS` maps an op type to a small function from a `Node` view to its
  output values; ONNX ops with no tg op of their own are compositions of tg ops
  (activations, normalizations, Gemm, Resize as gathers and weighted sums of taps
  computed here, ConvTranspose as a convolution of the zero-stuffed input, RNN/GRU/
  LSTM unrolled over their static sequence length). An op without a converter
  that ONNX defines as a function (Attention, the losses, RotaryEmbedding, ...) is
  expanded into ONNX's own function body, whose nodes are converted in its place.
  Inputs that must be static (shapes, axes, pads, sizes) are read from the known
  values; when one is computed from a graph input, `StaticInputNeeded` names the
  graph inputs that would have to be given as `constant_inputs`.
* Attribute-vs-input variants across opsets (axes of Reduce*/Squeeze/Unsqueeze,
  Split sizes, Pad pads, Clip bounds, ...) are read from whichever is present.

The package, by job: `load` (loading and checking), `values` (Values, ONNX tensors and
attributes as NumPy), `node` (the `Node` view and the `CONVERTERS` registry), `importer`
(the graph walk, function-body expansion, folding); the converters by op family:
`elementwise`, `layout`, `reductions`, `nn`, `quantized`, `sampling`, `scatter`,
`recurrent`, `control_flow`, `spectral`, `closed_forms`, `training`, and `run_time` (sizes known
only at run time: NonZero, Unique, computed TopK k, symbolic Resize, SAME padding and RNN lengths).
"""

# Importing each family registers its converters in CONVERTERS; run_time last, as it
# wraps some of the others' converters.
from tilegraph.frontends.onnx import (closed_forms, control_flow, elementwise, layout, nn, quantized,  # noqa: F401
                                      recurrent, reductions, sampling, scatter, spectral, training)
from tilegraph.frontends.onnx import run_time  # noqa: F401,E402
from tilegraph.frontends.onnx.importer import from_onnx
from tilegraph.frontends.onnx.load import MIN_OPSET, check_supported, load_model, unsupported_ops
from tilegraph.frontends.onnx.node import CONVERTERS, Node
from tilegraph.frontends.onnx.values import StaticInputNeeded

__all__ = ["CONVERTERS", "MIN_OPSET", "Node", "StaticInputNeeded", "check_supported", "from_onnx", "load_model",
           "unsupported_ops"]
