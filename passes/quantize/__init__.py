"""`quantize`: store weights in low precision, and compute in it where the backend can.

What it decides: for every `tg.matmul` whose right operand is a 2-D float weight (a
linear layer, [K, N]), how its weight and its activation are stored and multiplied,
by the scheme (`quantize{scheme=w8a8}`):

    scheme  weight                              activation                 the product
    w8      i8, per output channel              float                      float matmul of the dequantized weight
    w4a16   i4, groups of 128 along K           float                      float matmul of the dequantized weight
    mxfp4   f4E2M1FN, MX blocks of 32 along K   float                      float matmul of the dequantized weight
    w8a8    i8, per output channel              i8 per tensor (calibrated, int8 x int8 -> int32 (tg.matmul_integer), for
                                                ui8 + zero point unless     real; one dequantize of the i32 result
                                                symmetric) or per row
                                                (dynamic, no calibration)
    fp8     f8E4M3FN, per output channel        f8E4M3FN per tensor / row  fake-quant: dequantize both, float matmul
    mxfp8   f8E4M3FN, MX blocks of 32 along K   f8E4M3FN MX blocks of 32   fake-quant: dequantize both, float matmul
                                                (always from the data)

Embedding tables (a 2-D float weight read by gather on axis 0) are stored in i8 with one scale
per row, in every scheme (`embeddings=false` keeps them float), as onnxruntime does.

Fake quantization is used only where NumPy has no low-precision GEMM: for fp8 the float32
GEMM of the dequantized values is the product an fp8 tensor core makes (the products of
3-bit mantissas are exact in float32, which accumulates), so the numbers are those of a
real fp8 kernel, but not its speed. Weight-only schemes dequantize the weight each call,
as weight-only kernels do in their prologue. (The Triton backend computes these forms in fp8 and
MX for real: backends/triton/quant.py.)

Scales (observers): a weight's scale maps its largest magnitude to the format's largest
value (`minmax`), or is the clipping that minimizes the squared error of that group
(`mse`: ratios MSE_RATIOS of the largest magnitude, plus the coarser granularity's scale,
so per channel is never worse than per tensor). MX scales are powers of two (f8E8M0FNU).
Rounding: to nearest (`rounding=nearest`), or GPTQ (`rounding=gptq hessians=<file>`,
passes/gptq.py): each layer's weights rounded in turn so that the layer's output on the
calibration inputs (their X^T X, from `passes.gptq.hessians`) stays close, for every weight
scheme; the scales and storage stay the scheme's.

Activation ranges come from `observe_ranges` (min/max, percentile or MSE over calibration
inputs), saved by `tilegraph quantize --calib` and read here from `calib=<file.npz>`;
without them activations are quantized from their own values at run time.

Per layer (or embedding table) formats: `formats="name=scheme,..."` (a scheme, or none for
float) overrides `scheme` for the layers it names. `mixed_precision` chooses them: per layer
the scheme, among the given ones and float, that the cost model predicts fastest on a
target, within an error budget measured on the calibration inputs.

The stated error bound (checked by tilegraph.testing.assert_within_quantization_bound on
every property-suite graph): the quantized model computes, within float rounding, what
`simulate=true` computes, which is the float model with each quantized tensor x replaced
by dequantize(quantize(x)); and each of those is within half an ulp of its format times
its scale of x (plus, for a calibrated clipping range, the distance of x beyond it). With
rounding=gptq, x for a weight is GPTQ's weight (on its grid), not the original: GPTQ bounds
the layer's calibration output error (never above round to nearest's), not each weight's.

The package, by job: `schemes` (the schemes; which matmuls and tables), `observers` (weight
scales, activation ranges), `files` (ranges and Hessians on disk), `transform` (the pass),
`mixed` (the mixed-precision search), `flow` (`quantize_model`, what `tilegraph quantize` runs).
"""

from tilegraph.passes.quantize.files import load_ranges, save_ranges, save_hessians
from tilegraph.passes.quantize.flow import Quantized, quantize_model
from tilegraph.passes.quantize.mixed import MixedPlan, layer_time, mixed_precision, output_agreement, relative_error
from tilegraph.passes.quantize.observers import Observer, _round_trip, activation_params, observe_ranges, weight_scale
from tilegraph.passes.quantize.schemes import (DEFAULT_PERCENTILE, FORMATS_SEPARATOR, GRANULARITIES, MSE_RATIOS,
                                               OBSERVER_SAMPLE, OBSERVERS, ROUNDINGS, SCHEMES, QuantizeError, Scheme,
                                               embedding_tables, layer_name, linear_layers, weight_value)
from tilegraph.passes.quantize.transform import Quantize

__all__ = ["DEFAULT_PERCENTILE", "FORMATS_SEPARATOR", "GRANULARITIES", "MSE_RATIOS", "OBSERVERS", "OBSERVER_SAMPLE",
           "ROUNDINGS", "SCHEMES", "MixedPlan", "Observer", "Quantize", "QuantizeError", "Quantized", "Scheme",
           "_round_trip", "activation_params", "embedding_tables", "layer_name", "layer_time",
           "linear_layers", "load_ranges", "mixed_precision", "observe_ranges", "output_agreement", "quantize_model",
           "relative_error", "save_ranges", "save_hessians", "weight_scale", "weight_value"]
