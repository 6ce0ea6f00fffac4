"""`tilegraph`: import, compile and check models from the command line.

    tilegraph import model.onnx -o model.mlir          # IR text + model.weights.npz
    tilegraph compile model.onnx --target numpy -o model_np.py
    tilegraph compile model.onnx --target triton -o model_triton.py --report
    tilegraph check model.onnx                         # tilegraph vs onnxruntime
    tilegraph calibrate                                # measure this CPU for the cost model
    tilegraph calibrate --target c                     # ... as the native C backend runs on it
    tilegraph cost model.onnx --hardware h100 --dim batch=8  # predicted time, kernel by kernel
    tilegraph cost model.onnx --hardware cpu --symbolic     # ... as formulas of the symbolic dims
    tilegraph cost decoder.onnx --decode --depth 2000       # one decode step (.gguf too): bytes, tokens/s bound
    tilegraph compile model.onnx -o model_np.py --report    # + kernels, buffers, planned peak memory
    tilegraph shard model.onnx --mesh 8 --hardware h100     # how to split it over 8 GPUs, predicted step time
    tilegraph run model.onnx --devices 4 --dim batch=4      # the sharded program on 4 local processes (gloo)
    tilegraph quantize model.onnx --calib samples.npz --scheme w8a8 -o model_q.mlir   # calibrate, quantize
    tilegraph export model_q.mlir -o model_q.onnx      # to ONNX (QDQ form if quantized) for onnxruntime
    tilegraph generate model.gguf -p "Once upon a time" -n 64   # stream text, print tokens/s
    tilegraph chat model.gguf                          # chat through the file's chat template

Every mistake in the input (a missing file, a malformed model, an unsupported op,
a shape mismatch) is one paragraph on stderr and exit status 2; `check` exits 1
when the outputs disagree.
"""

from __future__ import annotations

import sys
from typing import Sequence

from tilegraph.cli.calibrate import _calibrate
from tilegraph.cli.check import _check
from tilegraph.cli.compile import _compile, _import
from tilegraph.cli.cost import _cost
from tilegraph.cli.export import _export
from tilegraph.cli.generate import _chat, _generate
from tilegraph.cli.parser import _parser
from tilegraph.cli.quantize import _quantize
from tilegraph.cli.run import _run
from tilegraph.cli.shard import _shard
from tilegraph.reporting import run_reporting_errors

COMMANDS = {"import": _import, "compile": _compile, "check": _check, "calibrate": _calibrate, "cost": _cost,
            "quantize": _quantize, "shard": _shard, "run": _run, "export": _export, "generate": _generate,
            "chat": _chat}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_reporting_errors(f"tilegraph {args.command}", lambda: COMMANDS[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
