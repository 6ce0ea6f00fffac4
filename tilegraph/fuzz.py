"""Fuzzing the inputs a user hands tilegraph: mutated files and command lines.

    python -m tilegraph.fuzz                       # 10,000 cases of each kind (the long run)
    python -m tilegraph.fuzz --kinds mlir,npz -n 500 --seed 7 --out fuzz-crashes

Kinds:
  mlir   the text of a small fused, tiled, symbolic model, mutated (bytes, tokens, lines),
         parsed and, when it parses, compiled and run on random inputs;
  onnx   protobuf field mutations of a small ONNX model (any field of any message:
         numbers, strings, bytes, repeated fields grown, shrunk or edited), imported,
         compiled and run;
  npz    the weights file beside a .mlir and a calibration samples file, as bytes
         mutated or as odd arrays (wrong dtypes, shapes, names, non-finite values);
  cli    `tilegraph` and `tilegraph-opt` command lines drawn from their options with odd
         values, run in this process;
  shapes, shapes_c   a valid ONNX model of shape-making ops (Tile, Split, Pad, MaxPool,
         Reshape, Concat, Slice, MatMul, Gather) with its sizes rewritten: entries of its
         integer tensors (repeats, split sizes, pads, shape, slice bounds), integer attributes
         (windows, strides, axes), input dims and ranks; compiled for NumPy (shapes) or C
         (shapes_c) and run with every symbolic dim bound to 1, 2 or 3, so that windows,
         splits and slices go empty or negative. Under TILEGRAPH_C_SANITIZE=address (the
         AddressSanitizer child of tests/test_c_asan.py) shapes_c checks memory too.

A case passes when it succeeds or fails with one of the errors a user is meant to see
(tilegraph.reporting.user_errors(): TilegraphError and the parser's and verifier's; for
the command line: exit status 0, 1 or 2 with no traceback printed). Anything else is a
crash: its input is saved under --out as a reproducer with the traceback, and the run
exits 1; so is a case that takes longer than CASE_TIME_LIMIT (a hang). `make test` runs a few hundred cases of each kind (tests/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable

import numpy as np

KINDS = ("mlir", "onnx", "npz", "cli", "shapes", "shapes_c")
# Sizes a shape mutation writes: small, zero, negative, one past, huge.
SHAPE_INTS = [-(2 ** 62), -7, -3, -2, -1, 0, 1, 2, 3, 4, 5, 8, 13, 2 ** 31, 2 ** 62]
# Strings a broken exporter or an attacker writes: line breaks, quotes, code, huge numbers.
ODD_STRINGS = ["", "x", "\n", "\x00", '"', "'''", "*/", "\u2028", "B", "?", "-1", "0", "1e309", "nan",
               "__import__('os')", "9" * 40, "é", "tensor<", "%0", "{", "}"]
ODD_INTS = [-(2 ** 63), -(2 ** 31), -5, -1, 0, 1, 2, 3, 7, 255, 2 ** 31 - 1, 2 ** 40, 2 ** 63 - 1]
# Tokens of the IR's text a mutation may insert.
MLIR_TOKENS = ["tg.add", "tg.matmul", "tg.fusion", "tg.yield", "tg.weight", "tensor<", ">", "?x", "xf32", "xi64",
               "xf16", "xi4", "%0", "%1", "%99", "=", ",", ":", "(", ")", "{", "}", "[", "]", '"B"', '"S*2"',
               '"S**9"', '"().__class__"', "array<i64: 1>", "-1", "0", "4294967296", "1.0e400", "func.return",
               "tile = {rows = 4 : i64}", 'name = "w"', "dense<1.0>", "\n", "\x00", "\xff"]


# Seconds one case may take before it counts as a hang (a crash): the slowest legitimate cases
# (a shard solve, a calibration) take a few seconds.
CASE_TIME_LIMIT = 60


class Crash(Exception):
    pass


class Hang(BaseException):
    """A case past CASE_TIME_LIMIT (a BaseException: no `except Exception` in the code under
    test may swallow it)."""


def _repeated(field) -> bool:
    # protobuf 5+ (upb) has `is_repeated`; older ones only `label`.
    return field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED


# --- seeds -------------------------------------------------------------------------------------


def seed_model():
    """A small model touching what the mutations should reach: symbolic dims, a weight, an
    embedding, fusion and tiling, a reduction."""
    from tilegraph.ir import Graph

    rng = np.random.default_rng(0)
    g = Graph()
    ids = g.input("ids", ("B", "S"), "i64")
    x = g.input("x", ("B", "S", 8))
    table = g.weight("emb", rng.standard_normal((16, 8)).astype(np.float32))
    w = g.weight("w", rng.standard_normal((8, 8)).astype(np.float32))
    h = g.relu((x + g.gather(table, ids)) @ w + 1.0)
    return g.build(g.softmax(h), names=["y"])


def seed_mlir_text() -> str:
    import tilegraph

    return tilegraph.compile(seed_model()).model.text


def seed_onnx():
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([-1, 6], np.int64), "shape"),
             numpy_helper.from_array(rng.standard_normal((10, 4)).astype(np.float32), "emb")]
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["e"], name="gather"),
             helper.make_node("Add", ["x", "e"], ["xe"], name="add0"),
             helper.make_node("MatMul", ["xe", "w"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "b"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Softmax", ["r"], ["s"], name="sm", axis=-1),
             helper.make_node("Reshape", ["s", "shape"], ["y"], name="rs"),
             helper.make_node("ReduceMean", ["y"], ["z"], name="rm", axes=[1], keepdims=1)]
    graph = helper.make_graph(nodes, "seed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4]),
                                              helper.make_tensor_value_info("ids", TensorProto.INT64, ["B"])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def seed_shapes_onnx():
    """Valid, symbolic, and made of the ops whose sizes come from the file: what the shape
    mutations rewrite."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    ints = lambda name, values: numpy_helper.from_array(np.array(values, np.int64), name)  # noqa: E731
    inits = [ints("reps", [1, 2, 1]), ints("split", [4, 4]), ints("pads", [0, 0, 1, 0, 0, 2]),
             ints("shape", [-1, 2]), ints("starts", [1]), ints("ends", [-1]), ints("axes", [1]),
             ints("ids", [0, 1]), numpy_helper.from_array(rng.standard_normal((2, 3)).astype(np.float32), "w")]
    nodes = [helper.make_node("Tile", ["x", "reps"], ["t"], name="tile"),
             helper.make_node("MaxPool", ["t"], ["p"], name="pool", kernel_shape=[2], strides=[1]),
             helper.make_node("Pad", ["p", "pads"], ["q"], name="pad"),
             helper.make_node("Split", ["q", "split"], ["s0", "s1"], name="split", axis=1),
             helper.make_node("Concat", ["s1", "s0"], ["c"], name="cat", axis=2),
             helper.make_node("Slice", ["c", "starts", "ends", "axes"], ["sl"], name="slice"),
             helper.make_node("Gather", ["sl", "ids"], ["g"], name="gather", axis=1),
             helper.make_node("Reshape", ["g", "shape"], ["r"], name="reshape"),
             helper.make_node("MatMul", ["r", "w"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "shapes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4, "L"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def mutate_shapes(proto, rng: np.random.Generator) -> None:
    """One rewrite of a size: an entry of an integer initializer, an integer attribute, an
    input dim (a number, a symbol, or the rank itself)."""
    from onnx import numpy_helper

    graph = proto.graph
    pick = lambda seq: seq[int(rng.integers(0, len(seq)))]  # noqa: E731
    choice = int(rng.integers(0, 3))
    if choice == 0:
        t = pick([t for t in graph.initializer if t.data_type == 7])  # INT64
        a = numpy_helper.to_array(t).copy()
        if a.size and rng.random() < 0.8:
            a.reshape(-1)[int(rng.integers(0, a.size))] = pick(SHAPE_INTS)
        else:  # grown or shrunk
            a = np.append(a, pick(SHAPE_INTS)) if rng.random() < 0.5 or not a.size else a[:-1]
        t.CopyFrom(numpy_helper.from_array(a.astype(np.int64), t.name))
    elif choice == 1:
        node = pick([n for n in graph.node if any(at.type in (2, 7) for at in n.attribute)])  # INT, INTS
        attr = pick([at for at in node.attribute if at.type in (2, 7)])
        if attr.type == 2:
            attr.i = pick(SHAPE_INTS)
        elif attr.ints:
            attr.ints[int(rng.integers(0, len(attr.ints)))] = pick(SHAPE_INTS)
    else:
        dims = graph.input[0].type.tensor_type.shape.dim
        r = rng.random()
        if r < 0.2 and len(dims) < 14:
            dims.add().dim_value = int(rng.integers(1, 4))
        elif r < 0.35 and len(dims) > 1:
            del dims[int(rng.integers(0, len(dims)))]
        else:
            d = dims[int(rng.integers(0, len(dims)))]
            if rng.random() < 0.5:
                d.dim_param = pick(["B", "L", "S", "N"])
            else:
                d.dim_value = pick([v for v in SHAPE_INTS if 0 <= v <= 13])  # inputs the harness can make


# --- running one model -------------------------------------------------------------------------


def _compile_and_run(load: Callable[[], object], rng: np.random.Generator, target: str = "numpy") -> None:
    import tilegraph
    from tilegraph.testing import random_inputs

    model = load()
    # The default pipeline on a third of the cases (fusion, tiling); the others go straight to
    # the emitter, three times as fast.
    compiled = tilegraph.compile(model, target=target, pipeline=None if rng.random() < 0.3 else "")
    compiled.run(*random_inputs(compiled.model, seed=int(rng.integers(1 << 30)), int_high=2))


# --- mutations ---------------------------------------------------------------------------------


def mutate_bytes(data: bytes, rng: np.random.Generator, tokens: list[bytes] | None = None) -> bytes:
    """1-4 edits: flip a byte, delete or duplicate a span, insert random bytes or a token, truncate."""
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 5))):
        n = len(b)
        what = int(rng.integers(0, 6))
        i = int(rng.integers(0, n + 1))
        if what == 0 and n:
            b[min(i, n - 1)] = int(rng.integers(0, 256))
        elif what == 1:
            del b[i:i + int(rng.integers(1, 40))]
        elif what == 2:
            span = b[i:i + int(rng.integers(1, 80))]
            j = int(rng.integers(0, n + 1))
            b[j:j] = span
        elif what == 3:
            b[i:i] = bytes(rng.integers(0, 256, int(rng.integers(1, 8))).astype(np.uint8))
        elif what == 4 and tokens:
            b[i:i] = tokens[int(rng.integers(0, len(tokens)))]
        elif what == 5:
            del b[i:]
    return bytes(b)


def mutate_mlir_token(text: bytes, rng: np.random.Generator) -> bytes:
    """One token of the IR text replaced by another of its class: an integer, a string, an op
    name, an element type or an SSA name."""
    import re

    from tilegraph.ir.ops import OPS

    classes = [(rb"(?<![\w%.])-?\d+(?![\w.])", [str(v).encode() for v in ODD_INTS + [4, 8, 16, 32768]]),
               (rb'"[^"\n]*"', [b'"' + "".join(c if c.isalnum() else f"\\{b:02X}" for c in v
                                                 for b in c.encode()).encode() + b'"' for v in ODD_STRINGS]),
               (rb"tg\.[a-z_]+", [f"tg.{name}".encode() for name in sorted(OPS)]),
               (rb"(?<=x)(f32|i64|f16|i8|i1)\b|(?<=<)(f32|i64)\b", [b"f32", b"i64", b"f16", b"bf16", b"i8", b"i1",
                                                                  b"i4", b"f64", b"f8E4M3FN", b"ui8"]),
               (rb"%\w+", [b"%0", b"%1", b"%2", b"%5", b"%x", b"%ids", b"%99"])]
    pattern, replacements = classes[int(rng.integers(0, len(classes)))]
    found = list(re.finditer(pattern, text))
    if not found:
        return text
    m = found[int(rng.integers(0, len(found)))]
    return text[:m.start()] + replacements[int(rng.integers(0, len(replacements)))] + text[m.end():]


def mutate_proto(message, rng: np.random.Generator) -> None:
    """Set one field somewhere in `message` (a protobuf) to an odd value of its type."""
    from google.protobuf.descriptor import FieldDescriptor as F

    msg = message
    for _ in range(12):  # walk down into a random submessage
        fields = msg.DESCRIPTOR.fields
        subs = [f for f in fields if f.type == F.TYPE_MESSAGE]
        present = [f for f in subs if (len(getattr(msg, f.name)) if _repeated(f)
                                       else msg.HasField(f.name))]
        if not present or rng.random() < 0.3:
            break
        f = present[int(rng.integers(0, len(present)))]
        value = getattr(msg, f.name)
        if _repeated(f):
            if rng.random() < 0.1 and len(value):
                del value[int(rng.integers(0, len(value)))]
                return
            if rng.random() < 0.05:
                value.add()
                return
            msg = value[int(rng.integers(0, len(value)))]
        else:
            msg = value
    scalars = [f for f in msg.DESCRIPTOR.fields if f.type != F.TYPE_MESSAGE]
    if not scalars:
        return
    f = scalars[int(rng.integers(0, len(scalars)))]
    target = getattr(msg, f.name)

    def odd():
        if f.type in (F.TYPE_STRING,):
            return ODD_STRINGS[int(rng.integers(0, len(ODD_STRINGS)))]
        if f.type == F.TYPE_BYTES:
            return bytes(rng.integers(0, 256, int(rng.integers(0, 24))).astype(np.uint8))
        if f.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
            return float(rng.choice([np.nan, np.inf, -np.inf, 0.0, -1.0, 1e30, 1e-30]))
        if f.type == F.TYPE_BOOL:
            return bool(rng.integers(0, 2))
        if f.type == F.TYPE_ENUM:
            return int(rng.choice([0, 1, 2, 3, 7, 11, 16, 17, 99]))
        v = ODD_INTS[int(rng.integers(0, len(ODD_INTS)))]
        if f.type in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_FIXED32, F.TYPE_FIXED64):
            v = abs(v) % (1 << (32 if f.type in (F.TYPE_UINT32, F.TYPE_FIXED32) else 64))
        if f.type in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
            v = max(-(2 ** 31), min(2 ** 31 - 1, v))
        return v

    try:
        if _repeated(f):
            if len(target) and rng.random() < 0.6:
                target[int(rng.integers(0, len(target)))] = odd()
            elif len(target) and rng.random() < 0.5:
                del target[int(rng.integers(0, len(target)))]
            else:
                target.append(odd())
        else:
            setattr(msg, f.name, odd())
    except (ValueError, TypeError):  # a value protobuf itself refuses (an enum out of range): no case
        pass


# --- the kinds ---------------------------------------------------------------------------------


class Fuzzer:
    def __init__(self, out: Path | None = None):
        self.out = out
        self.tmp = Path(tempfile.mkdtemp(prefix="tilegraph-fuzz-"))
        self._mlir = None
        self._onnx = None

    def mlir_case(self, rng: np.random.Generator) -> dict[str, bytes]:
        from tilegraph.ir.model import Model, decode_text

        if self._mlir is None:
            model = seed_model()
            self._mlir = (seed_mlir_text().encode(), {k: np.asarray(v) for k, v in model.weights.items()})  # type: ignore[assignment]
        text, weights = self._mlir  # type: ignore[misc]
        if rng.random() < 0.6:  # edits that keep the text parseable, so the verifier and backends see it
            data = text
            for _ in range(int(rng.integers(1, 4))):
                data = mutate_mlir_token(data, rng)
        else:
            data = mutate_bytes(text, rng, [t.encode("utf-8", "surrogateescape") if t != "\xff" else b"\xff"
                                            for t in MLIR_TOKENS])
        self._case = {"model.mlir": data}
        _compile_and_run(lambda: Model.parse(decode_text(data, "model.mlir"), dict(weights)), rng)
        return self._case

    def _mutated_onnx(self, seed: bytes, mutate, rng: np.random.Generator) -> bytes:
        """The seed model with one to three mutations, serialized: this case's file."""
        import onnx

        proto = onnx.load_model_from_string(seed)
        for _ in range(int(rng.integers(1, 4))):
            mutate(proto, rng)
        data = proto.SerializeToString()
        self._case = {"model.onnx": data}
        return data

    def onnx_case(self, rng: np.random.Generator) -> dict[str, bytes]:
        from tilegraph.frontends.onnx import from_onnx

        if self._onnx is None:
            self._onnx = seed_onnx().SerializeToString()
        data = self._mutated_onnx(self._onnx, mutate_proto, rng)
        _compile_and_run(lambda: from_onnx(data), rng)
        return self._case

    def shapes_case(self, rng: np.random.Generator, target: str = "numpy") -> dict[str, bytes]:

        import tilegraph
        from tilegraph.frontends.onnx import from_onnx
        from tilegraph.ir.shapes import free_symbols
        from tilegraph.testing import random_inputs

        if getattr(self, "_shapes", None) is None:
            self._shapes = seed_shapes_onnx().SerializeToString()
        data = self._mutated_onnx(self._shapes, mutate_shapes, rng)
        compiled = tilegraph.compile(from_onnx(data), target=target, pipeline=None if rng.random() < 0.3 else "")
        symbols = sorted(set().union(*(free_symbols(t.shape) for t in compiled.model.inputs)))
        for _ in range(2):  # two bindings: small sizes make windows, splits and slices empty or negative
            sizes = {name: int(rng.integers(1, 4)) for name in symbols}
            compiled.run(*random_inputs(compiled.model, seed=int(rng.integers(1 << 30)), sizes=sizes, int_high=2))
        return self._case

    def shapes_c_case(self, rng: np.random.Generator) -> dict[str, bytes]:
        return self.shapes_case(rng, target="c")

    def npz_case(self, rng: np.random.Generator) -> dict[str, bytes]:
        from tilegraph.cli.quantize import _calibration_batches
        from tilegraph.ir.model import Model

        model = seed_model()
        path = self.tmp / "m.mlir"
        model.save(path)
        weights = path.with_suffix(".weights.npz")
        calib = self.tmp / "calib.npz"
        good = {"ids": rng.integers(0, 16, (4, 2, 3)), "x": rng.standard_normal((4, 2, 3, 8)).astype(np.float32)}
        np.savez(calib, **good)
        victim = weights if rng.random() < 0.5 else calib
        if rng.random() < 0.5:
            victim.write_bytes(mutate_bytes(victim.read_bytes(), rng))
        else:
            arrays = dict(np.load(victim, allow_pickle=False))
            key = list(arrays)[int(rng.integers(0, len(arrays)))]
            choice = int(rng.integers(0, 7))
            if choice == 0 and arrays[key].dtype.kind in "biuf":
                arrays[key] = arrays[key].astype(rng.choice(["f2", "i1", "u8", "c8", "?", "i8", "f8"]))
            elif choice == 1:
                arrays[key] = arrays[key].reshape(-1)[: int(rng.integers(0, arrays[key].size + 1))]
            elif choice == 2:
                del arrays[key]
            elif choice == 3:
                arrays[ODD_STRINGS[int(rng.integers(1, len(ODD_STRINGS)))].replace("\x00", "_") or "k"] = \
                    arrays.pop(key)
            elif choice == 4 and arrays[key].dtype.kind == "f" and arrays[key].size:
                arrays[key].reshape(-1)[0] = rng.choice([np.nan, np.inf])
            elif choice == 5:
                arrays["__dtypes__"] = np.array(ODD_STRINGS[int(rng.integers(0, len(ODD_STRINGS)))] or "{}")
            else:
                arrays[key] = np.zeros((0,) + arrays[key].shape[1:], arrays[key].dtype)
            np.savez(victim, **arrays)
        self._case = {"model.mlir": path.read_bytes(), "model.weights.npz": weights.read_bytes(),
                      "calib.npz": calib.read_bytes()}
        loaded = Model.load(path)
        _calibration_batches(calib, loaded, 2)
        _compile_and_run(lambda: loaded, rng)
        return self._case

    def cli_case(self, rng: np.random.Generator) -> dict[str, bytes]:
        from tilegraph.cli import main as tilegraph_main
        from tilegraph.opt import main as opt_main

        model = self.tmp / "cli.mlir"
        if not model.exists():
            seed_model().save(model)
            np.savez(self.tmp / "cli-calib.npz", ids=rng.integers(0, 16, (4, 2, 3)),
                     x=rng.standard_normal((4, 2, 3, 8)).astype(np.float32))
        pick = lambda seq: seq[int(rng.integers(0, len(seq)))]  # noqa: E731
        odd = ["0", "-1", "1", "2", "8", "x", "", "B=0", "B=2", "B=-1", "B=x", "S=2", "Q=3", "=4", "B=2=3",
               "nan", "1e400", "2x0", "0x2", "1x1", "abc", "quantize", "canonicalize,", "fuse{hardware=tpu}",
               "constant-fold{max-elements=-1}", "tile{max-rows=x}", str(self.tmp / "nope.mlir"), "\x01", "é"]
        commands = {
            "compile": ["--target", "-p", "--report", "--dim"],
            "cost": ["--target", "-p", "--dim", "--symbolic"],
            "import": [],
            "export": ["-p"],
            "quantize": ["--scheme", "--calib", "--observer", "--percentile", "--batch-size", "--max-error",
                         "--min-cosine", "--fallback", "--target", "--symmetric"],
            "shard": ["--mesh", "--target", "--memory", "--dim", "--inference", "--symbolic"],
            "opt": ["-p", "--dim", "--target", "--hardware", "--print-cost-after-all", "--remarks", "-f"],
        }
        command = pick(list(commands))
        values = {"--target": ["numpy", "cpu", "h100", "triton", "tpu"], "--scheme": ["w8", "w8a8", "mxfp4", "w4a16"],
                  "--calib": [str(self.tmp / "cli-calib.npz"), str(model)], "--fallback": ["none", "w8", "w8a8"],
                  "--observer": ["minmax", "percentile", "mse", "x"], "-f": ["mlir", "onnx", "pt2", "x"],
                  "-p": ["canonicalize", "canonicalize,cse", "quantize{scheme=w8}", "dce"],
                  "--mesh": ["1", "2", "2x2", "0", "x", "1x1"], "--hardware": ["cpu", "c", "h100", "tpu"]}
        argv = [command] if command != "opt" else []
        argv.append(str(model) if rng.random() < 0.9 else pick(odd))
        for _ in range(int(rng.integers(0, 4))):
            option = pick(commands[command]) if commands[command] else "--dim"
            argv.append(option)
            if option not in ("--report", "--symbolic", "--symmetric", "--inference", "--print-cost-after-all",
                              "--remarks"):
                argv.append(pick(values.get(option, odd)) if rng.random() < 0.6 else pick(odd))
        if command in ("compile", "import", "export", "quantize") or (command == "opt" and rng.random() < 0.5):
            argv += ["-o", str(self.tmp / ("out" + pick([".py", ".mlir", ".onnx"])))]
        self._case = {"argv.txt": "\0".join(argv).encode("utf-8", "surrogateescape")}
        main = opt_main if command == "opt" else tilegraph_main
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's refusal of an option
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if code not in (0, 1, 2) or "Traceback" in err.getvalue():
            raise Crash(f"exit {code}: {err.getvalue()[-2000:]}")
        return self._case

    def run(self, kind: str, n: int, seed: int = 0, progress: bool = False) -> list[str]:
        """Run `n` cases of `kind`; returns one line per crash (its reproducer saved under out)."""
        from tilegraph.reporting import user_errors

        import signal
        import threading

        case = getattr(self, f"{kind}_case")
        crashes = []
        timed = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM")

        def hang(*_):
            raise Hang(f"no result after {CASE_TIME_LIMIT} s")

        previous = signal.signal(signal.SIGALRM, hang) if timed else None
        for i in range(n):
            rng = np.random.default_rng([seed, KINDS.index(kind), i])
            self._case = {}
            try:
                if timed:
                    signal.alarm(CASE_TIME_LIMIT)
                case(rng)
            except user_errors():
                pass
            except (Exception, RecursionError, Hang) as e:  # noqa: BLE001 - anything else is what we look for
                crashes.append(self._save(kind, seed, i, e))
            finally:
                if timed:
                    signal.alarm(0)
            if progress and (i + 1) % 500 == 0:
                print(f"  {kind}: {i + 1}/{n}, {len(crashes)} crashes", file=sys.stderr, flush=True)
        if timed:
            signal.signal(signal.SIGALRM, previous)
        return crashes

    def _save(self, kind: str, seed: int, i: int, e: BaseException) -> str:
        line = f"{kind} seed={seed} case={i}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        if self.out is not None:
            where = self.out / f"{kind}-{seed}-{i}"
            where.mkdir(parents=True, exist_ok=True)
            for name, data in self._case.items():
                (where / name).write_bytes(data)
            (where / "traceback.txt").write_text("".join(traceback.format_exception(e)))
            line += f" -> {where}"
        return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("-n", type=int, default=10_000, help="cases of each kind (default 10000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="fuzz-crashes", help="where reproducers of crashes go")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kinds {unknown}; the kinds are {', '.join(KINDS)}")
    fuzzer = Fuzzer(Path(args.out))
    total = 0
    for kind in kinds:
        crashes = fuzzer.run(kind, args.n, args.seed, progress=True)
        total += len(crashes)
        print(f"{kind}: {args.n} cases, {len(crashes)} crashes")
        for line in crashes[:20]:
            print(f"  {line}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
