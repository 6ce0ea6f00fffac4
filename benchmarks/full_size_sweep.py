"""Full-size models at the sizes people run them: tilegraph's C backend against onnxruntime,
OpenVINO (f32, and its default precision) and torch eager, in one run, interleaved.

arch_sweep.py's tiny configurations hide the per-model cliffs (a 224x224 image at batch 1
met oneDNN's reference convolution; a 16-token text never meets attention's real cost).
Here every model has its published size and random weights (built from transformers'
configs, nothing downloaded):

  resnet50, convnext-t, efficientnet-b0, mobilenet-v2 (transformers has no MobileNetV3),
  vit-b16, vit-s16, swin-t, regnet-y-040 (RegNetConfig's defaults: RegNetY-4.0GF's widths and
  depths): one 224x224 image (--batch for more); bert-base: 128 tokens; llama-0.3b: a
  Llama-shaped decoder (1024 wide, 20 layers, grouped-query attention), a prompt of 128;
  whisper-tiny-enc: Whisper tiny's encoder on 30 s of audio (80 x 3000 mel frames);
  wav2vec2-base: wav2vec 2.0 base (its convolutional feature encoder and 12 layers) on 30 s
  of 16 kHz audio; and at the longer sizes people also run: bert-base-s512 (512 tokens),
  llama-0.3b-p1024 (a prompt of 1024); mobilenet-v3-large, densenet-121, maxvit-t: torchvision's
  models, which transformers has no config for, in plain torch (vision_models.py), at 224.

Each model runs in a child process of its own: eager torch is the reference; tilegraph
compiles the torch.export program (target "c"); torch's ONNX exporter writes the file
onnxruntime and OpenVINO run. Every runner's relative error against eager is printed
beside its time. `--precision bf16` adds tilegraph compiled with precision="bf16" (and, for the
attention models, `folded-bf16`: bf16 with spelled-out attention folded to the flash kernel;
`--fold` adds `folded`, the same at f32).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/full_size_sweep.py [--only resnet50,bert-base]
        [--repeat 7] [--threads N] [--batch 1] [--precision bf16] [--fold] [--save rows.json] [--no-eager]

Each row also gives the model's FLOPs as written (convolutions direct) and the f32 GEMM rate
tilegraph reaches in the same process at the same threads; a runner's time against both is
its share of that peak, how much faster any f32 kernel could make it.

Timing: benchmarks/_common.py's round-robin (each call after a pause), medians; the
ratios are medians of per-round ratios. The load average is printed beside the table:
on a shared machine, other processes' load moves every runner's time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, format_table, interleaved_samples, machine_lines, paired_ratio  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# name -> (transformers model_type, config overrides, input kind). Defaults of transformers'
# configs are the published base sizes where not overridden (ResNetConfig: ResNet-50,
# ConvNextConfig: ConvNeXt-T, ViTConfig: ViT-B/16 at 224, SwinConfig: Swin-T, BertConfig: BERT-base).
MODELS = {
    "resnet50": ("resnet", {}, "image"),
    "mobilenet-v2": ("mobilenet_v2", {}, "image"),
    "efficientnet-b0": ("efficientnet", dict(width_coefficient=1.0, depth_coefficient=1.0, image_size=224,
                                             hidden_dim=1280), "image"),
    "convnext-t": ("convnext", {}, "image"),
    "vit-b16": ("vit", {}, "image"),
    "vit-s16": ("vit", dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536),
                "image"),
    "swin-t": ("swin", {}, "image"),
    "regnet-y-040": ("regnet", {}, "image"),
    "bert-base": ("bert", {}, "text_mask"),
    "llama-0.3b": ("llama", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
                                 num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                                 max_position_embeddings=2048), "text"),
    "whisper-tiny-enc": ("whisper", dict(d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
                                         decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536,
                                         num_mel_bins=80, max_source_positions=1500), "mel"),
    "wav2vec2-base": ("wav2vec2", {}, "waveform"),
    # torchvision's definitions in plain torch (vision_models.py): no transformers config
    **{name: (None, {}, "image") for name in ("mobilenet-v3-large", "densenet-121", "maxvit-t")},
}
# The same models at longer inputs: name -> (model, tokens).
LONGER = {"bert-base-s512": ("bert-base", 512), "llama-0.3b-p1024": ("llama-0.3b", 1024)}
SEQ = 128  # tokens of a text input (a prompt)
IMAGE = 224
AUDIO_SAMPLES = 30 * 16_000  # 30 s at 16 kHz, wav2vec 2.0's rate


def build(name: str, batch: int):
    """(module returning one tensor, input names, input tensors)."""
    import torch
    from transformers import AutoConfig, AutoModel

    name, seq = LONGER.get(name, (name, SEQ))
    model_type, overrides, kind = MODELS[name]
    torch.manual_seed(0)
    if model_type is None:
        import vision_models

        model = vision_models.build(name)
    else:
        config = AutoConfig.for_model(model_type, **overrides)
        model = AutoModel.from_config(config, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(0)
    if kind == "image":
        inputs = {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=g)}
        _settle_batch_norms(model, torch.randn(2, 3, IMAGE, IMAGE, generator=g))
    elif kind == "mel":
        model = model.encoder
        inputs = {"input_features": torch.randn(batch, 80, 3000, generator=g)}
    elif kind == "waveform":
        inputs = {"input_values": torch.randn(batch, AUDIO_SAMPLES, generator=g)}
    else:
        inputs = {"input_ids": torch.randint(3, 1000, (batch, seq), generator=g)}
        if kind == "text_mask":
            inputs["attention_mask"] = torch.ones(batch, seq, dtype=torch.int64)

    class First(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            kwargs = dict(zip(inputs, tensors))
            if model_type is None:  # a plain torch module: its one output
                return self.model(**kwargs)
            if "use_cache" in model.forward.__code__.co_varnames:
                kwargs["use_cache"] = False
            return self.model(**kwargs, return_dict=False)[0]

    return First().eval(), list(inputs), tuple(inputs.values())


def _settle_batch_norms(model, images) -> None:
    """Batch norms as a trained network's: scale 1 (transformers draws some from N(0, 0.02))
    and running statistics from one forward in training mode. With the initial ones the
    activations shrank block by block, and EfficientNet-B0's output underflowed to exactly
    0 (nothing left to check, and a peer may fold what it sees is zero)."""
    import torch

    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    for m in norms:
        m.reset_running_stats()
        if m.affine:
            with torch.no_grad():
                m.weight.fill_(1.0)
        m.momentum = None  # a plain average over the batches seen: here, this one
    model.train()
    with torch.no_grad():
        model(pixel_values=images)
    model.eval()


def run_one(name: str, batch: int, repeat: int, threads: int | None, precisions: list[str],
            time_eager: bool = True, fold_f32: bool = False) -> dict:
    import numpy as np
    import onnxruntime as ort
    import torch

    import tilegraph
    from tilegraph.testing import relative_error

    sys.path.insert(0, str(ROOT))
    from tests.models import export_onnx

    if threads:
        torch.set_num_threads(threads)
    row: dict = {"name": name, "batch": batch, "errors": {}, "notes": []}
    module, names, inputs = build(name, batch)
    arrays = [t.numpy() for t in inputs]
    feeds = dict(zip(names, arrays))
    with torch.no_grad():
        ref = module(*inputs).numpy().astype(np.float64)
    runners = {"eager": lambda: module(*inputs)} if time_eager else {}

    def check(key, out):
        row["errors"][key] = float(relative_error(np.asarray(out, dtype=np.float64), ref))

    options = {"threads": threads} if threads else {}
    used: dict[str, list[int]] = {}  # tilegraph runner -> the threads each of its calls started with
    t0 = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(module, inputs)
    from tilegraph.passes.cost.model import forward_flops

    row["gflop"] = forward_flops(tilegraph.import_model(program).module) / 1e9
    for precision in precisions:
        key = "tilegraph" if precision == "f32" else f"tilegraph-{precision}"
        try:
            extra = {} if precision == "f32" else {"precision": precision}
            compiled = tilegraph.compile(program, target="c", **options, **extra)
            check(key, compiled.run(*arrays)[0])
            runners[key] = _counting_threads(compiled, arrays, used.setdefault(key, []))
            if compiled.reference_kernels:
                row["notes"].append(f"{key}: {len(compiled.reference_kernels)} primitive(s) on oneDNN's reference "
                                    f"kernel: {compiled.reference_kernels[0]}")
        except Exception as e:  # a row, not a crash: the table says what failed
            row["notes"].append(f"{key}: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
    for precision in [p for p in precisions if p == "bf16" or fold_f32]:
        if not any(n in name for n in ("vit", "bert", "swin", "whisper", "llama", "wav2vec2")):
            break
        # Every spelled-out attention folded to the flash kernel (at bf16 its products on AMX
        # where the processor has it); the default folds at bf16 only over enough keys
        # (registry.C_BF16_FOLD_MIN_KEYS), at f32 where the scores outgrow a core's cache: this column,
        # in the same rounds, says whether it should.
        from tilegraph.passes.registry import UNFUSED_PIPELINE

        key = "folded" if precision == "f32" else f"folded-{precision}"
        extra = {} if precision == "f32" else {"precision": precision}
        folded = tilegraph.compile(program, target="c", **options, **extra,
                                   pipeline=UNFUSED_PIPELINE + ",attention,fuse{hardware=c},tile{hardware=c}")
        check(key, folded.run(*arrays)[0])
        runners[key] = (lambda f: lambda: f.run(*arrays))(folded)
    row["compile_s"] = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        path = export_onnx(module, inputs, Path(d) / "m.onnx", names, ["out"])
        opts = ort.SessionOptions()
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as arch_sweep.py: no spinning pool
        if threads:
            opts.intra_op_num_threads = threads
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        check("onnxruntime", sess.run(None, feeds)[0])
        runners["onnxruntime"] = lambda: sess.run(None, feeds)
        try:
            import openvino as ov

            core = ov.Core()
            for key, hint in (("openvino-f32", {"INFERENCE_PRECISION_HINT": "f32"}), ("openvino", {})):
                config = {"PERFORMANCE_HINT": "LATENCY", **hint}
                if threads:
                    config["INFERENCE_NUM_THREADS"] = threads
                net = core.compile_model(str(path), "CPU", config)
                request = net.create_infer_request()
                check(key, request.infer(feeds)[0])
                runners[key] = (lambda r: lambda: r.infer(feeds))(request)
            row["openvino_default_precision"] = str(core.get_property("CPU", "INFERENCE_PRECISION_HINT"))
        except ImportError:
            row["notes"].append("openvino not installed (pip install openvino): its columns are empty")
        with torch.no_grad():
            samples = interleaved_samples(runners, repeat)
    row["times"] = {k: float(np.median(s)) for k, s in samples.items()}
    row["gemm_gflops"] = gemm_rate(options)
    row["ratios"] = {f"{a}/{b}": paired_ratio(samples, a, b)[0] for a in samples if a.startswith("tilegraph")
                     for b in samples if not b.startswith("tilegraph")}
    row["load"] = os.getloadavg()
    for key, counts in used.items():
        if counts and min(counts) != max(counts):
            row["notes"].append(f"{key} started on {min(counts)} thread(s) in {counts.count(min(counts))} of "
                                f"{len(counts)} calls, {max(counts)} in the rest (other processes' runnable threads)")
        elif counts:
            row["notes"].append(f"{key} started on {counts[0]} thread(s) in every call")
    return row


def gemm_rate(options: dict, n: int = 1024, calls: int = 15) -> float:
    """GFLOP/s of tilegraph's best n x n x n f32 GEMM at the sweep's threads (oneDNN's, at this
    core's peak as onnxruntime's and OpenVINO's are): a model's FLOPs over its time, divided by
    this, is how close to the processor's f32 limit a runtime already runs it."""
    import numpy as np
    import torch

    import tilegraph

    a = torch.randn(n, n)
    gemm = tilegraph.compile(torch.export.export(torch.nn.Linear(n, n, bias=False), (a,)), target="c", **options)
    x = a.numpy()
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        gemm.run(x)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9 if np.isfinite(best) else 0.0


def _counting_threads(compiled, arrays, counts: list[int]):
    """A runner that notes the threads each call started with: at all threads the C backend
    starts with no more than the cores other processes leave free (backends/c/runtime.
    _uncontended_threads), so on a loaded machine its row may be one thread against a peer's
    two; the note under the table says how often."""
    def call():
        out = compiled.run(*arrays)
        counts.append(int(getattr(compiled._runner, "last_threads", 0)))
        return out
    return call


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated model names (default: all): " + ", ".join([*MODELS, *LONGER]))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeat", type=int, default=7, help="timed round-robin rounds (median)")
    p.add_argument("--threads", type=int, help="threads of every runner (default: each library's own)")
    p.add_argument("--precision", default="f32", help="tilegraph precisions to time, comma-separated (f32,bf16)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per model")
    p.add_argument("--save", help="write the rows as JSON to this file")
    p.add_argument("--no-eager", action="store_true",
                   help="eager torch computes the reference but is not timed (on a loaded machine its spinning "
                        "threads take seconds a call)")
    p.add_argument("--fold", action="store_true",
                   help="also time f32 with every spelled-out attention folded to the flash kernel (`folded`; "
                        "bf16's `folded-bf16` is always timed)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    precisions = args.precision.split(",")
    if "f32" not in precisions:
        precisions.insert(0, "f32")
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.batch, args.repeat, args.threads, precisions,
                                             not args.no_eager, args.fold)))
        return 0
    names = args.only.split(",") if args.only else [*MODELS, *LONGER]
    rows = []
    for name in names:
        cmd = [sys.executable, __file__, "--one", name, "--batch", str(args.batch), "--repeat", str(args.repeat),
               "--precision", ",".join(precisions)] + (["--threads", str(args.threads)] if args.threads else []) \
            + (["--no-eager"] if args.no_eager else []) + (["--fold"] if args.fold else [])
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            row = json.loads(lines[-1][7:]) if lines else {
                "name": name, "notes": ["failed: " + " ".join(proc.stderr.strip().splitlines()[-1:])[:300]]}
        except subprocess.TimeoutExpired:
            row = {"name": name, "notes": [f"timed out after {args.timeout:.0f} s"]}
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(f"{name}: {row['seconds']:.0f} s " + "; ".join(
            f"{k} {v * 1e3:.1f} ms" for k, v in row.get("times", {}).items()), flush=True)
        if args.save:
            Path(args.save).write_text(json.dumps(rows, indent=1))
    report(rows, args, precisions)
    return 0


def report(rows, args, precisions) -> None:
    import numpy as np

    print()
    print("\n".join(machine_lines()))
    print(f"batch {args.batch}; threads: {args.threads or 'each library default'}; medians of {args.repeat} "
          f"round-robin rounds, each call after a pause; ratios: medians of per-round ratios")
    peers = ["onnxruntime", "openvino-f32", "openvino", "eager"]
    peers += [k for k in ("folded", "folded-bf16") if any(k in r.get("times", {}) for r in rows)]
    ours = ["tilegraph" if p == "f32" else f"tilegraph-{p}" for p in precisions]
    header = ["model"] + [f"{k} ms" for k in ours + peers] + [f"{a}/{b}" for a in ours for b in peers] + \
        [f"err {k}" for k in ours + peers] + ["GFLOP", "GEMM GFLOP/s"] + \
        [f"{k} of GEMM peak" for k in ("tilegraph", "onnxruntime")] + ["load avg"]
    table = []
    for r in rows:
        t, q, e = r.get("times", {}), r.get("ratios", {}), r.get("errors", {})
        table.append([r["name"]] + [f"{t[k] * 1e3:.1f}" if k in t else "-" for k in ours + peers]
                     + [f"{q[f'{a}/{b}']:.2f}" if f"{a}/{b}" in q else "-" for a in ours for b in peers]
                     + [f"{e[k]:.1e}" if k in e else "-" for k in ours + peers]
                     + [f"{r['gflop']:.1f}" if "gflop" in r else "-", f"{r['gemm_gflops']:.0f}" if "gemm_gflops" in r else "-"]
                     + [f"{r['gflop'] / t[k] / r['gemm_gflops']:.2f}" if k in t and r.get("gemm_gflops") else "-"
                        for k in ("tilegraph", "onnxruntime")]
                     + [" ".join(f"{x:.1f}" for x in r.get("load", ()))])
    print(format_table(header, table))
    for a in ours:
        for b in peers:
            ratios = [r["ratios"][f"{a}/{b}"] for r in rows if f"{a}/{b}" in r.get("ratios", {})]
            if ratios:
                print(f"{a}/{b}: geometric mean {float(np.exp(np.mean(np.log(ratios)))):.2f} over {len(ratios)} models")
    shares = [r["gflop"] / r["times"]["onnxruntime"] / r["gemm_gflops"] for r in rows
              if r.get("gemm_gflops") and "onnxruntime" in r.get("times", {})]
    if shares:
        floor = float(np.exp(np.mean(np.log(shares))))
        print(f"onnxruntime runs these models at a geometric mean {floor:.2f} of the f32 GEMM peak: a geomean "
              f"tilegraph/onnxruntime below {floor:.2f} needs fewer FLOPs than the models spell (Winograd), "
              f"not faster kernels")
    defaults = {r.get("openvino_default_precision") for r in rows} - {None}
    if defaults:
        print(f"OpenVINO's default inference precision on this processor: {', '.join(sorted(defaults))}")
    for r in rows:
        for note in r.get("notes", []):
            print(f"  {r['name']}: {note}")


if __name__ == "__main__":
    sys.exit(main())
