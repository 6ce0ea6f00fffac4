"""ONNX operator names of tg ops: what the ONNX frontend reads and the exporter writes.

Below both (backends never import a frontend), one table per direction would drift
apart: the frontend maps ONNX -> tg with these, the exporter inverts them.
"""

UNARY = {
    "Abs": "abs", "Neg": "neg", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Reciprocal": "reciprocal",
    "Tanh": "tanh", "Sigmoid": "sigmoid", "Relu": "relu", "Erf": "erf", "Sin": "sin", "Cos": "cos", "Tan": "tan",
    "Asin": "asin", "Acos": "acos", "Atan": "atan", "Sinh": "sinh", "Cosh": "cosh", "Asinh": "asinh",
    "Acosh": "acosh", "Atanh": "atanh", "Floor": "floor", "Ceil": "ceil", "Round": "round", "Sign": "sign",
    "Not": "not", "IsNaN": "isnan", "BitwiseNot": "bitwise_not",
}

BINARY = {
    "Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "BitwiseAnd": "bitwise_and",
    "BitwiseOr": "bitwise_or", "BitwiseXor": "bitwise_xor", "And": "and", "Or": "or", "Xor": "xor",
    "Equal": "eq", "Less": "lt", "LessOrEqual": "le", "Greater": "gt", "GreaterOrEqual": "ge",
}

# ONNX reductions -> the op table's reduction kinds (and the ones the frontend spells out).
REDUCE = {"ReduceSum": "sum", "ReduceMean": "mean", "ReduceMax": "max", "ReduceMin": "min", "ReduceProd": "prod",
          "ReduceL1": "l1", "ReduceL2": "l2", "ReduceLogSum": "log_sum", "ReduceLogSumExp": "log_sum_exp",
          "ReduceSumSquare": "sum_square"}
