"""Frontend coverage: many architectures, each through torch.export and through ONNX, against torch eager.

Every model is built from its config with small sizes and random weights (nothing is
downloaded): transformers' text encoders, decoders, encoder-decoders, mixture-of-experts
decoders, vision and audio models, and a few plain torch.nn ones. Each one runs

* eager: the module in torch, the reference;
* torch route: `tilegraph.compile(module, inputs, target=...)` (torch.export inside);
* ONNX route: torch's exporter writes an .onnx file (the legacy TorchScript exporter,
  opset 17, as tests/models.py does), `tilegraph.compile(path, target=...)` runs it;
* onnxruntime on the same file, the peer that shows whether the file itself is right.

A route is correct when its output is within `tilegraph.testing.PEER_RELATIVE_ERROR`
of eager's. A failure of torch's own exporter is listed apart (it says nothing about
tilegraph). Each model runs in a child process of its own with a time limit, so one
crash or hang costs one row.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/arch_sweep.py [--only bert,vit] [--family text] [--quick]
        [--target numpy] [--time [--repeat 7] [--threads N] [--inductor]] [--timeout 600] [--save rows.json]
    .venv/bin/python benchmarks/arch_sweep.py --report run1.json,run2.json   # merged rows, no run

`--time` adds the median latency of tilegraph (torch route), torch eager and onnxruntime
(round-robin, benchmarks/_common.py) and the ratios tilegraph/eager and tilegraph/onnxruntime
with their geometric means; `--inductor` adds torch.compile (timed after its compiling call) as a
third peer. `--quick` keeps only the QUICK architectures, the ones that build and run fastest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _common import ROOT, format_table, interleaved_samples, machine_lines  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SEQ = 16  # tokens of a text input
IMAGE = 32  # pixels a side of an image input
AUDIO = 4000  # samples of a raw-audio input


@dataclass(frozen=True)
class Arch:
    name: str
    family: str  # text, decoder, seq2seq, moe, vision, audio, torch
    model_type: str  # transformers' model_type, or "" for a plain torch module
    config: dict = field(default_factory=dict)
    inputs: str = "text"  # which example inputs (see example_inputs)


# Small text transformer sizes, in each config's own spelling.
BERTISH = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=128,
               max_position_embeddings=64)
LLAMAISH = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=128, max_position_embeddings=64)
MOE = dict(LLAMAISH, num_experts_per_tok=2)
BARTISH = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128,
               max_position_embeddings=64, pad_token_id=1, decoder_start_token_id=2)
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=IMAGE,
           patch_size=8)
WAV = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
           conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
           num_conv_pos_embedding_groups=4, do_stable_layer_norm=False)

ARCHS = [
    # text encoders
    Arch("bert", "text", "bert", BERTISH, "text_mask"),
    Arch("roberta", "text", "roberta", dict(BERTISH, pad_token_id=1), "text_mask"),
    Arch("distilbert", "text", "distilbert", dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=128,
                                                  max_position_embeddings=64), "text_mask"),
    Arch("albert", "text", "albert", dict(BERTISH, embedding_size=16), "text_mask"),
    Arch("electra", "text", "electra", dict(BERTISH, embedding_size=16), "text_mask"),
    Arch("deberta", "text", "deberta", BERTISH, "text_mask"),
    Arch("deberta-v2", "text", "deberta-v2", BERTISH, "text_mask"),
    Arch("mpnet", "text", "mpnet", BERTISH, "text_mask"),
    Arch("mobilebert", "text", "mobilebert", dict(BERTISH, embedding_size=16, intra_bottleneck_size=16,
                                                  true_hidden_size=16, num_feedforward_networks=1), "text_mask"),
    Arch("convbert", "text", "convbert", dict(BERTISH, embedding_size=32), "text_mask"),
    Arch("squeezebert", "text", "squeezebert", dict(BERTISH, embedding_size=32, q_groups=2, k_groups=2, v_groups=2,
                                                    post_attention_groups=2, intermediate_groups=2,
                                                    output_groups=2), "text_mask"),
    Arch("xlm-roberta", "text", "xlm-roberta", dict(BERTISH, pad_token_id=1), "text_mask"),
    Arch("ernie", "text", "ernie", BERTISH, "text_mask"),
    Arch("modernbert", "text", "modernbert", dict(BERTISH, global_attn_every_n_layers=2, local_attention=8,
                                                  pad_token_id=0), "text_mask"),
    # decoders
    Arch("gpt2", "decoder", "gpt2", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64)),
    Arch("gpt-neo", "decoder", "gpt_neo", dict(hidden_size=32, num_layers=2, num_heads=4, vocab_size=128,
                                               max_position_embeddings=64, attention_types=[[["global", "local"], 1]],
                                               window_size=8)),
    Arch("gptj", "decoder", "gptj", dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, vocab_size=128,
                                         n_positions=64)),
    Arch("opt", "decoder", "opt", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                                       vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=32)),
    Arch("llama", "decoder", "llama", LLAMAISH),
    Arch("mistral", "decoder", "mistral", LLAMAISH),
    Arch("qwen2", "decoder", "qwen2", LLAMAISH),
    Arch("qwen3", "decoder", "qwen3", dict(LLAMAISH, head_dim=8)),
    Arch("phi", "decoder", "phi", dict(LLAMAISH, num_key_value_heads=4)),
    Arch("phi3", "decoder", "phi3", dict(LLAMAISH, pad_token_id=0)),
    Arch("gemma", "decoder", "gemma", dict(LLAMAISH, head_dim=8)),
    Arch("gemma2", "decoder", "gemma2", dict(LLAMAISH, head_dim=8, sliding_window=8)),
    Arch("falcon", "decoder", "falcon", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             vocab_size=128, new_decoder_architecture=False, multi_query=True)),
    Arch("bloom", "decoder", "bloom", dict(hidden_size=32, n_layer=2, n_head=4, vocab_size=128)),
    Arch("stablelm", "decoder", "stablelm", LLAMAISH),
    Arch("gpt-neox", "decoder", "gpt_neox", dict(BERTISH)),
    Arch("codegen", "decoder", "codegen", dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, vocab_size=128,
                                               n_positions=64, n_ctx=64)),
    Arch("olmo", "decoder", "olmo", LLAMAISH),
    Arch("granite", "decoder", "granite", LLAMAISH),
    # mixture of experts
    Arch("mixtral", "moe", "mixtral", dict(MOE, num_local_experts=4)),
    Arch("qwen2-moe", "moe", "qwen2_moe", dict(MOE, num_experts=4, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=64)),
    Arch("qwen3-moe", "moe", "qwen3_moe", dict(MOE, num_experts=4, moe_intermediate_size=32, head_dim=8)),
    Arch("olmoe", "moe", "olmoe", dict(MOE, num_experts=4)),
    # encoder-decoders
    Arch("t5", "seq2seq", "t5", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=128,
                                     decoder_start_token_id=0), "seq2seq"),
    Arch("bart", "seq2seq", "bart", BARTISH, "seq2seq"),
    Arch("mbart", "seq2seq", "mbart", BARTISH, "seq2seq"),
    Arch("pegasus", "seq2seq", "pegasus", BARTISH, "seq2seq"),
    Arch("marian", "seq2seq", "marian", dict(BARTISH, decoder_vocab_size=128), "seq2seq"),
    # vision
    Arch("vit", "vision", "vit", VIT, "image"),
    Arch("deit", "vision", "deit", VIT, "image"),
    Arch("beit", "vision", "beit", VIT, "image"),
    Arch("dinov2", "vision", "dinov2", dict(VIT, image_size=IMAGE), "image"),
    Arch("swin", "vision", "swin", dict(image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1],
                                        num_heads=[2, 2], window_size=4), "image"),
    Arch("convnext", "vision", "convnext", dict(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1]), "image"),
    Arch("convnextv2", "vision", "convnextv2", dict(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1]), "image"),
    Arch("resnet", "vision", "resnet", dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]), "image"),
    Arch("regnet", "vision", "regnet", dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                            groups_width=4), "image"),
    Arch("mobilenet-v2", "vision", "mobilenet_v2", dict(depth_multiplier=0.25, image_size=IMAGE), "image"),
    Arch("efficientnet", "vision", "efficientnet", dict(width_coefficient=0.25, depth_coefficient=0.2,
                                                        image_size=IMAGE, hidden_dim=320), "image"),
    Arch("segformer", "vision", "segformer", dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                                  hidden_sizes=[8, 16], num_attention_heads=[1, 2],
                                                  patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2],
                                                  decoder_hidden_size=16), "image"),
    Arch("mobilevit", "vision", "mobilevit", dict(image_size=IMAGE, hidden_sizes=[16, 24, 32],
                                                  neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64]), "image"),
    Arch("poolformer", "vision", "poolformer", dict(hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1]), "image"),
    Arch("levit", "vision", "levit", dict(image_size=IMAGE, hidden_sizes=[16, 24, 32], num_attention_heads=[1, 2, 2],
                                          depths=[1, 1, 1], key_dim=[8, 8, 8]), "image"),
    # audio
    Arch("wav2vec2", "audio", "wav2vec2", WAV, "audio"),
    Arch("hubert", "audio", "hubert", WAV, "audio"),
    Arch("wavlm", "audio", "wavlm", dict(WAV, num_buckets=32), "audio"),
    Arch("whisper", "audio", "whisper", dict(d_model=32, encoder_layers=2, decoder_layers=2,
                                             encoder_attention_heads=4, decoder_attention_heads=4,
                                             encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128,
                                             num_mel_bins=16, max_source_positions=32, max_target_positions=32,
                                             decoder_start_token_id=1, pad_token_id=0), "whisper"),
    Arch("ast", "audio", "audio-spectrogram-transformer", dict(VIT, num_mel_bins=32, max_length=32,
                                                                 patch_size=8, frequency_stride=8,
                                                                 time_stride=8), "spectrogram"),
    # plain torch.nn
    Arch("cnn", "torch", "", inputs="cnn"),
    Arch("lstm", "torch", "", inputs="sequence"),
    Arch("gru", "torch", "", inputs="sequence"),
]


# 31 architectures of every family but the slowest to build and export (MoE, encoder-decoders,
# raw audio): `--quick` runs these, e.g. for a timed C-backend sweep (their correctness run
# with --target c took 14 min on the loaded 2-core machine, 30 min for all 65).
QUICK = ["bert", "roberta", "distilbert", "albert", "electra", "gpt2", "opt", "llama", "mistral", "qwen2", "qwen3", "phi", "phi3", "gemma", "falcon", "bloom",
         "stablelm", "gpt-neox", "olmo", "granite", "vit", "deit", "dinov2", "convnext", "resnet", "regnet",
         "mobilenet-v2", "poolformer", "cnn", "lstm", "gru"]


# --- building ------------------------------------------------------------------------------


def example_inputs(kind: str, config=None) -> dict:
    """Named example inputs of one kind (the names are the model's keyword arguments)."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, 120, (1, n), generator=g)  # noqa: E731
    if kind == "text":
        return {"input_ids": ids(SEQ)}
    if kind == "text_mask":
        mask = torch.ones(1, SEQ, dtype=torch.int64)
        mask[0, -3:] = 0  # some padding, so the mask matters
        return {"input_ids": ids(SEQ), "attention_mask": mask}
    if kind == "seq2seq":
        return {"input_ids": ids(SEQ), "decoder_input_ids": ids(SEQ // 2)}
    if kind == "image":
        return {"pixel_values": torch.randn(1, 3, IMAGE, IMAGE, generator=g)}
    if kind == "audio":
        return {"input_values": torch.randn(1, AUDIO, generator=g)}
    if kind == "whisper":
        return {"input_features": torch.randn(1, config.num_mel_bins, 2 * config.max_source_positions, generator=g),
                "decoder_input_ids": ids(4)}
    if kind == "spectrogram":
        return {"input_values": torch.randn(1, config.max_length, config.num_mel_bins, generator=g)}
    if kind == "cnn":
        return {"x": torch.randn(2, 3, 16, 16, generator=g)}
    if kind == "sequence":
        return {"x": torch.randn(2, 7, 8, generator=g)}
    raise KeyError(kind)


# The experts paths tried, in order, for an MoE ONNX file (see the ONNX route in run_one).
MOE_ONNX_FALLBACKS = ("eager", "batched_mm")


def build(arch: Arch, **model_kwargs):
    """(module returning one tensor, names of its inputs, example input tensors); `model_kwargs`
    go to transformers' from_config (experts_implementation)."""
    import torch

    torch.manual_seed(0)
    if not arch.model_type:
        module = plain_module(arch.name)
        inputs = example_inputs(arch.inputs)
    else:
        from transformers import AutoConfig, AutoModel

        config = AutoConfig.for_model(arch.model_type, **arch.config)
        model = AutoModel.from_config(config, attn_implementation="eager", **model_kwargs)
        module = FirstOutput(model.eval(), "use_cache" in model.forward.__code__.co_varnames)
        inputs = example_inputs(arch.inputs, config)
        module.names = list(inputs)
    return module.eval(), list(inputs), tuple(inputs.values())


def plain_module(name: str):
    from torch import nn

    sys.path.insert(0, str(ROOT))
    if name == "cnn":
        from tests.models import small_cnn

        return small_cnn()

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = (nn.LSTM if name == "lstm" else nn.GRU)(8, 16, num_layers=1, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0]

    return Recurrent()


def _first_output_class():
    import torch

    class FirstOutput(torch.nn.Module):
        """A transformers model as a module of positional tensors returning its first output
        (the last hidden state, or the decoder's for an encoder-decoder)."""

        def __init__(self, model, cache_flag: bool):
            super().__init__()
            self.model = model
            self.cache_flag = cache_flag
            self.names: list[str] = []

        def forward(self, *tensors):
            kwargs = dict(zip(self.names, tensors))
            if self.cache_flag:
                kwargs["use_cache"] = False
            out = self.model(**kwargs, return_dict=False)
            return out[0]

    return FirstOutput


def __getattr__(name):  # FirstOutput is built lazily: the parent process never imports torch
    if name == "FirstOutput":
        return _first_output_class()
    raise AttributeError(name)


# --- one model, in a child process ---------------------------------------------------------


def short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:160]}"


def run_one(arch: Arch, target: str, time_it: bool, repeat: int, threads: int | None = None,
            inductor: bool = False, back_to_back: bool = False) -> dict:
    import numpy as np
    import torch

    import tilegraph
    from tilegraph.testing import PEER_RELATIVE_ERROR, relative_error

    sys.path.insert(0, str(ROOT))
    from tests.models import export_onnx, run_onnx

    global FirstOutput
    FirstOutput = _first_output_class()
    if threads:
        torch.set_num_threads(threads)
    row: dict = {"name": arch.name, "family": arch.family, "target": target}
    module, names, inputs = build(arch)
    with torch.no_grad():
        ref = module(*inputs).numpy()
    arrays = [t.numpy() for t in inputs]

    def check(out) -> str:
        err = relative_error(np.asarray(out, dtype=np.float64), ref)
        return "ok" if err <= PEER_RELATIVE_ERROR else f"wrong (rel. error {err:.1e})"

    runners = {"eager": lambda: module(*inputs)}
    options = {"threads": threads} if threads and target == "c" else {}  # the peers' thread count
    # torch route
    try:
        from torch.export import export

        with torch.no_grad():
            program = export(module, inputs)
    except Exception as e:  # torch's exporter, not tilegraph
        row["torch"], row["torch_detail"] = "export failed", short(e)
    else:
        try:
            compiled = tilegraph.compile(program, target=target, **options)
            row["torch"] = check(compiled(*arrays))
            runners["tilegraph"] = lambda: compiled(*arrays)
        except Exception as e:
            row["torch"], row["torch_detail"] = "error", short(e)
    # ONNX route
    with tempfile.TemporaryDirectory() as d:
        try:
            try:
                path = export_onnx(module, inputs, Path(d) / "m.onnx", names, ["out"])
            except Exception:
                if arch.family != "moe":
                    raise
                # transformers' default experts path calls its own custom op, which the TorchScript
                # exporter cannot write. Its eager path (same weights, same results) exports: a loop
                # over the experts hit, routed by NonZero (data-dependent sizes; the trace keeps the
                # count of experts it saw, which tilegraph checks when it runs); batched_mm if not.
                for impl in MOE_ONNX_FALLBACKS:
                    try:
                        path = export_onnx(build(arch, experts_implementation=impl)[0], inputs,
                                           Path(d) / "m.onnx", names, ["out"])
                    except Exception:
                        if impl == MOE_ONNX_FALLBACKS[-1]:
                            raise
                        continue
                    row["onnx_note"] = f"exported with experts_implementation={impl}"
                    break
        except Exception as e:
            row["onnx"] = row["ort"] = "export failed"
            row["onnx_detail"] = short(e)
        else:
            try:
                feeds = dict(zip(names, arrays))
                row["ort"] = check(run_onnx(path, feeds)[0])
                import onnxruntime as ort

                opts = ort.SessionOptions()
                # its pool threads would otherwise spin after each call and take the cores
                # from the runner timed next
                opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
                if threads:
                    opts.intra_op_num_threads = threads
                sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
                runners["onnxruntime"] = lambda: sess.run(None, feeds)
            except Exception as e:
                row["ort"] = "error: " + short(e)
            try:
                compiled_onnx = tilegraph.compile(str(path), target=target, **options)
                row["onnx"] = check(compiled_onnx(*arrays))
                runners.setdefault("tilegraph", lambda: compiled_onnx(*arrays))
            except Exception as e:
                row["onnx"], row["onnx_detail"] = "error", short(e)
    if time_it and inductor:
        try:
            fast = torch.compile(module)
            with torch.no_grad():
                fast(*inputs)  # compiles
            runners["inductor"] = lambda: fast(*inputs)
        except Exception as e:
            row["inductor_detail"] = short(e)
    if time_it:
        with torch.no_grad():
            samples = interleaved_samples(runners, repeat, back_to_back=back_to_back)
            row["times"] = {name: float(np.median(s)) for name, s in samples.items()}
    return row


# --- the sweep ---------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated model names")
    p.add_argument("--family", help="comma-separated families (text, decoder, moe, seq2seq, vision, audio, torch)")
    p.add_argument("--target", default="numpy", help="tilegraph.compile's target (default numpy)")
    p.add_argument("--time", action="store_true", help="also time tilegraph, torch eager and onnxruntime")
    p.add_argument("--repeat", type=int, default=7, help="timed rounds per model with --time (median)")
    p.add_argument("--threads", type=int, help="threads of torch, onnxruntime and the C backend with --time (default: "
                                                "theirs); on a loaded machine pools of 2 threads wait for cores")
    p.add_argument("--inductor", action="store_true", help="with --time, also time torch.compile (Inductor)")
    p.add_argument("--back-to-back", action="store_true",
                   help="with --time, time each call right after an untimed one of the same runner (pools awake, "
                        "caches warm, as in a serving loop; benchmarks/_common.py) instead of after a pause")
    p.add_argument("--quick", action="store_true", help=f"only the QUICK architectures ({len(QUICK)})")
    p.add_argument("--timeout", type=float, default=600, help="seconds per model")
    p.add_argument("--save", help="write the rows as JSON to this file")
    p.add_argument("--report", help="print the report of saved rows (comma-separated files, later rows "
                                    "replacing earlier ones of the same model) instead of running")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one model, a JSON line out
    args = p.parse_args()
    by_name = {a.name: a for a in ARCHS}
    if args.one:
        print("RESULT " + json.dumps(run_one(by_name[args.one], args.target, args.time, args.repeat, args.threads,
                                             args.inductor, args.back_to_back)))
        return 0
    if args.report:
        merged: dict[str, dict] = {}
        for f in args.report.split(","):
            merged.update({r["name"]: r for r in json.loads(Path(f).read_text())})
        report([merged[a.name] for a in ARCHS if a.name in merged], args)
        return 0
    archs = ARCHS
    if args.only:
        archs = [by_name[n] for n in args.only.split(",")]
    if args.quick:
        archs = [a for a in archs if a.name in QUICK]
    if args.family:
        archs = [a for a in archs if a.family in args.family.split(",")]
    rows = []
    for arch in archs:
        cmd = [sys.executable, __file__, "--one", arch.name, "--target", args.target, "--repeat", str(args.repeat)]
        cmd += ["--time"] if args.time else []
        cmd += ["--threads", str(args.threads)] if args.threads else []
        cmd += ["--inductor"] if args.inductor else []
        cmd += ["--back-to-back"] if args.back_to_back else []
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if lines:
                row = json.loads(lines[-1][len("RESULT "):])
            else:
                tail = " ".join(proc.stderr.strip().splitlines()[-1:])[:160]
                row = {"name": arch.name, "family": arch.family, "torch": "build failed", "onnx": "build failed",
                       "ort": "-", "torch_detail": tail}
        except subprocess.TimeoutExpired:
            row = {"name": arch.name, "family": arch.family, "torch": "timeout", "onnx": "timeout", "ort": "-"}
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(f"{arch.name:14s} torch: {row['torch']:28s} onnx: {row['onnx']:28s} ort: {row.get('ort', '-')}  "
              f"({row['seconds']:.0f} s)", flush=True)
        if args.save:
            Path(args.save).write_text(json.dumps(rows, indent=1))
    report(rows, args)
    return 0


def report(rows: list[dict], args) -> None:
    import numpy as np

    print()
    print("\n".join(machine_lines()))
    print(f"target: {', '.join(sorted({r.get('target', args.target) for r in rows}))}")
    if any("times" in r for r in rows) and not args.report:
        print(f"timed: medians of {args.repeat} round-robin rounds, "
              f"{'back to back' if args.back_to_back else 'each call after a pause (settled)'}, threads: "
              f"{args.threads or 'each library default'}")
    header = ["model", "family", "torch.export", "ONNX", "onnxruntime"]
    timed = any("times" in r for r in rows)  # so --report shows a --time run's times too
    inductor = any("inductor" in r.get("times", {}) for r in rows)
    if timed:
        header += ["tg ms", "eager ms", "ort ms", "tg/eager", "tg/ort"] + ["inductor ms", "tg/inductor"] * inductor
    table = []
    for r in rows:
        line = [r["name"], r["family"], r["torch"], r["onnx"], r.get("ort", "-")]
        if timed:
            t = r.get("times", {})
            ms = lambda k: f"{t[k] * 1e3:.2f}" if k in t else "-"  # noqa: E731
            ratio = lambda a, b: f"{t[a] / t[b]:.2f}" if a in t and b in t else "-"  # noqa: E731
            line += [ms("tilegraph"), ms("eager"), ms("onnxruntime"), ratio("tilegraph", "eager"),
                     ratio("tilegraph", "onnxruntime")] + [ms("inductor"), ratio("tilegraph", "inductor")] * inductor
        table.append(line)
    print(format_table(header, table, "lllll" + "r" * (len(header) - 5)))
    print()
    n = len(rows)
    for route in ("torch", "onnx"):
        exported = [r for r in rows if r[route] not in ("export failed", "build failed")]
        ok = sum(r[route] == "ok" for r in exported)
        print(f"{route:5s} route: {ok}/{len(exported)} correct of the models torch exported "
              f"({100 * ok / max(len(exported), 1):.0f}%); {n - len(exported)} export or build failures")
    either = sum(r["torch"] == "ok" or r["onnx"] == "ok" for r in rows)
    ort_ok = sum(r.get("ort") == "ok" for r in rows)
    print(f"correct through at least one route: {either}/{n}; onnxruntime correct on {ort_ok} exported files")
    if timed:
        for a, b in (("tilegraph", "eager"), ("tilegraph", "onnxruntime"), ("tilegraph", "inductor")):
            ratios = [r["times"][a] / r["times"][b] for r in rows if a in r.get("times", {}) and b in r["times"]]
            if ratios:
                print(f"{a}/{b}: geometric mean {float(np.exp(np.mean(np.log(ratios)))):.2f} over {len(ratios)} models")
    for r in rows:
        if "onnx_note" in r:
            print(f"  {r['name']}: ONNX file {r['onnx_note']}")
    failures = [(r["name"], route, r.get(f"{route}_detail", "")) for r in rows for route in ("torch", "onnx")
                if r[route] != "ok"]
    if failures:
        print("\nnot correct (exporter failures are torch's, the rest tilegraph's):")
        for name, route, detail in failures:
            status = next(r[route] for r in rows if r["name"] == name)
            print(f"  {name} [{route}] {status}: {detail}")


if __name__ == "__main__":
    sys.exit(main())
