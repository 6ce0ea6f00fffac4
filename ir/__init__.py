"""tilegraph's IR: the tg dialect on xDSL, symbolic shapes, the builder, weights, the interpreter."""

from tilegraph.ir.builder import Graph, Tensor
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.model import Model, ModelError, WeightStore, parse_module, print_module
from tilegraph.ir.shapes import ShapeError, TensorInfo

__all__ = ["Graph", "Tensor", "Model", "ModelError", "WeightStore", "parse_module", "print_module",
           "ShapeError", "TensorInfo", "TilegraphError", "interpret"]


def interpret(model, inputs, float64=True, values=None):
    from tilegraph.ir.interpreter import interpret as _interpret

    return _interpret(model, inputs, float64, values)
