"""PyTorch frontend: a `torch.export` program onto the tg dialect.

    batch = torch.export.Dim("batch")
    model = from_torch(module, (ids, mask), dynamic_shapes=({0: batch}, {0: batch}))
    model = from_exported_program(ep)          # an ExportedProgram you already have
    model = load_pt2("model.pt2")               # torch.export.save'd file

What it decides, and how:

* The op level. `torch.export.export` gives ATen ops at about the level the user
  wrote: linear, layer_norm, softmax, scaled_dot_product_attention, conv2d,
  batch_norm. These map one-to-one onto tg ops and composites, so they are
  converted as they stand. Only when the graph holds an op with no converter, or
  an in-place op, is the program run through `run_decompositions` with a table that
  keeps the ops tg has whole (`KEEP_WHOLE`) and lowers the rest to core ATen
  (which also removes mutation). Converters cover both levels (`linear` and
  `addmm`, `layer_norm` and `native_layer_norm`, `max_pool2d` and
  `max_pool2d_with_indices`, ...), so a user's already-decomposed program imports too.
* Names. Parameters, buffers and lifted constants become `tg.weight` ops named by
  their state-dict key ("bert.encoder.layer.0.attention.self.query.weight"), made
  when first used; user inputs become @forward arguments named as in the signature.
* Shapes. A symbolic size (torch's SymInt `s43`) becomes a tg symbol named after
  the `torch.export.Dim` the user gave ("batch"), else after torch's symbol. Size
  arithmetic (`sym_size`, `operator.mul`) is not converted node by node: every
  node's `meta["val"]` already holds its value as a sympy expression.
* Types. Each node's result is checked against torch's own fake-tensor metadata:
  a shape that differs is a frontend bug and is reported; the dtype is made to
  agree. Operands are cast to the result dtype (torch promotion), comparisons to
  `torch.result_type` of their operands.
* Errors. A first pass lists every unsupported op, with its count and first node,
  in one FrontendError; a converter that cannot handle its arguments (a
  dropout in training mode) names the node and the op.
"""

from tilegraph.frontends.torch_export.importer import (  # noqa: F401
    from_exported_program, from_torch, load_pt2, refuse_pickled_code, decomposition_table, torch_dtype, to_numpy)
from tilegraph.frontends.torch_export.registry import CONVERTERS, UNKNOWN_NAMES  # noqa: F401
# The converter families register themselves on import.
from tilegraph.frontends.torch_export import creation, elementwise, layout, nn, reductions, run_time  # noqa: F401,E402
