"""Sharding plans for training GPT- and Llama-shaped models on H100s: the planner's layout
(passes/parallel_degrees.py's degree search around passes/shard.py's integer program) against data
parallelism and Megatron-LM's hand layout, priced by the same cost model in the same run,
and the planner's predictions beside throughputs the Megatron-LM paper reports.

    python benchmarks/shard_plans.py                     # the training table and the anchors
    python benchmarks/shard_plans.py --table one-axis    # the earlier table: 1-8 devices on one axis

Training table (`--devices 8,16,64`, global batch `--batch 256` sequences; models built from
their configs with zero-strided weights, frontends/config.py: nothing is materialised):
  GPT-2 small  12 layers, hidden 768, 12 heads, vocabulary 50304 (padded), sequence 1024
  GPT 1.3B     24 layers, hidden 2048, 16 heads, vocabulary 50304, sequence 2048
  Llama 7B     Llama-2-7B's config: 32 layers, hidden 4096, MLP 11008, 32 heads, vocabulary
               32000, sequence 4096
  planner   the search's best (data x tensor x pipeline x sequence degrees, micro-batches m,
            ZeRO stage, recomputation); DP and Megatron take the ZeRO stage and recomputation
            the planner finds best for them:
  data      pure data parallelism over every device (ZeRO-1/2 allowed)
  megatron  Megatron-LM's tensor parallelism inside a node (t = 8, or the largest power of two
            dividing the heads), data parallelism across nodes, no pipeline
Each row: predicted step time, model-FLOPs utilisation (the model's forward + backward FLOPs
over the devices' bf16 peak; recomputation does not count), memory per device; "no fit":
nothing fits 80 GB.

Anchors (A100s, Narayanan et al., SC21, Table 1: sequence 2048, vocabulary 51200, global batch
512, full activation recomputation): the paper's configuration (its layout, every layer
recomputed) priced by the cost model, as TFLOP/s per GPU by the paper's own FLOP count
(96 B s l h^2 (1 + s/6h + V/16lh), which counts the recomputed forward), beside the reported
TFLOP/s; MFU counts the model's FLOPs only.
"""

from __future__ import annotations

import argparse
import sys
import time

# Run as a script, this directory is on sys.path; _common (imported by its own name: xdsl
# installs a top-level `benchmarks` package) puts the repository root on it too.
from _common import format_table, machine_lines  # noqa: E402

MODELS = {
    "GPT-2 small": dict(layers=12, d_model=768, heads=12, seq=1024),
    "GPT 1.3B": dict(layers=24, d_model=2048, heads=16, seq=2048),
}
COLUMN = ("attn.wq", "attn.wk", "attn.wv", "mlp.fc1", "mlp.w1", "mlp.w3", "lm_head")
ROW = ("attn.wo", "mlp.fc2", "mlp.w2")
COLUMN_BIAS = ("attn.bq", "attn.bk", "attn.bv", "mlp.b1")


def _weight_of(node) -> str:
    return node.label.split("(")[1].rstrip(")") if "(" in node.label else ""


def megatron(node):
    """Megatron-LM's layout: the strategy names each weight, matmul and attention must take."""
    op = node.op
    if op is None:
        return None
    if op.op_name == "weight":
        name = node.label
        if name.endswith(COLUMN):
            return {"d1@0"}
        if name.endswith(ROW) or name.endswith(COLUMN_BIAS):
            return {"d0@0"}
        return {"R"}
    if op.op_name == "matmul":
        w = _weight_of(node)
        return {"n@0"} if w.endswith(COLUMN) else {"k@0"} if w.endswith(ROW) else None
    if op.op_name == "attention":
        return {"d1@0"}  # heads
    return None


def data_parallel(node):
    op = node.op
    if op is None:
        return {"d0@0"}
    if op.op_name == "weight":
        return {"R"}
    if op.op_name == "matmul":
        return {"b0@0"}
    if op.op_name in ("attention", "gather"):
        return {"d0@0"}
    return None


def describe(p) -> str:
    """'data', 'tensor', or 'data + tensor: lm_head' (the few matmuls split by columns or rows)."""
    matmuls = [(_weight_of(c.node), c.strategy.name.split("@")[0]) for c in p.choices
               if c.node.op is not None and c.node.op.op_name == "matmul"]
    data = [w for w, k in matmuls if k in ("b0", "m")]
    tensor = [w for w, k in matmuls if k in ("n", "k")]
    if data and tensor:
        return "data + tensor: " + ", ".join(tensor) if len(tensor) <= 2 else "data + tensor"
    return "data" if data else "tensor" if tensor else "replicated"


def tensor_layout(t_axis: int, d_axis: int | None):
    """Megatron-LM's layout on a mesh: tensor parallelism over `t_axis` (columns then rows, heads),
    data parallelism over `d_axis` (None: no data axis)."""
    data = f"b0@{d_axis}," if d_axis is not None else ""

    def only(node):
        op = node.op
        if op is None:
            return {f"d0@{d_axis}"} if d_axis is not None else {"R"}
        if op.op_name == "weight":
            name = node.label
            if name.endswith(COLUMN):
                return {f"d1@{t_axis}"}
            if name.endswith(ROW) or name.endswith(COLUMN_BIAS):
                return {f"d0@{t_axis}"}
            return {"R"}
        if op.op_name == "matmul":
            w = _weight_of(node)
            want = f"{data}n@{t_axis}" if w.endswith(COLUMN) else f"{data}k@{t_axis}" if w.endswith(ROW) else None
            return None if want is None else {st.name for st in node.strategies if st.name.split(">")[0] == want}
        if op.op_name == "attention":
            return {f"d0@{d_axis},d1@{t_axis}" if d_axis is not None else f"d1@{t_axis}"}
        return None

    return only


TABLE_MODELS = {
    "GPT-2 small": dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50304),
    "GPT 1.3B": dict(n_embd=2048, n_layer=24, n_head=16, n_positions=2048, vocab_size=50304),
    "Llama 7B": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000),
}
SEQ = {"Llama 7B": 4096}
# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", SC21, Table 1 (A100 80GB, global batch 512): (name, heads, hidden, layers,
# tensor, pipeline, GPUs, reported TFLOP/s per GPU).
ANCHORS = [("1.7B", 24, 2304, 24, 1, 1, 32, 137), ("3.6B", 32, 3072, 30, 2, 1, 64, 138),
           ("7.5B", 32, 4096, 36, 4, 1, 128, 142)]


def _row(name, lay, flops, devices):
    from tilegraph.passes.parallel_degrees import mfu

    if isinstance(lay, str):
        return [name, lay, "-", "-", "-", "-", "-"]
    p = lay.plan
    return [name, lay.describe(), f"{lay.time * 1e3:.1f}", f"{100 * mfu(lay, flops, devices):.1f}",
            f"{100 * p.bubble / p.time:.1f}" if p.time else "-", f"{p.memory / 1e9:.1f}", f"{p.solve_time:.1f}"]


def training_table(args) -> None:
    from tilegraph.frontends.config import from_config
    from tilegraph.passes.cost.collectives import GPUS_PER_NODE, Mesh
    from tilegraph.passes.cost.hardware import hardware
    from tilegraph.passes.parallel_degrees import Layout, degrees, model_flops, search
    from tilegraph.passes.shard import LayoutError, ShardError, plan

    hw = hardware("h100")
    print(f"target: {hw.name} ({hw.memory_bytes / 1e9:.0f} GB, NVLink {hw.links['nvlink'].beta / 1e9:.0f} GB/s, "
          f"InfiniBand {hw.links['infiniband'].beta / 1e9:.0f} GB/s per direction per GPU, "
          f"{GPUS_PER_NODE} per node), training step, global batch {args.batch}")
    for title, config in TABLE_MODELS.items():
        seq = SEQ.get(title)
        model = from_config(config, seq=seq) if seq is None else from_config(config)
        sizes = {"B": args.batch} | ({"S": seq} if seq else {})
        flops = model_flops(model.module, sizes)
        heads = config.get("n_head") or config["num_attention_heads"]
        rows = []
        for n in (int(d) for d in args.devices.split(",")):
            t0 = time.perf_counter()
            best, tried = search(model.module, n, hw, sizes, pipelines=[p for p in (1, 2, 4, 8) if n % p == 0])
            took = time.perf_counter() - t0
            results = {"planner": best or "no fit"}

            def fixed(shape, only):
                try:
                    p = plan(model.module, Mesh(shape, hw), sizes=sizes, only=only, runner_up=False)
                    return Layout(p, 1, 1, degrees(p))
                except LayoutError:
                    return "n/a"
                except ShardError:
                    return "no fit"

            results["data"] = fixed((n,), data_parallel)
            t = max(k for k in (1, 2, 4, 8) if heads % k == 0 and n % k == 0)
            results["megatron"] = fixed((n // t, t), tensor_layout(1, 0)) if n > t else fixed((t,), megatron)
            for name, lay in results.items():
                rows.append([n if name == "planner" else ""] + _row(name, lay, flops, n))
            rows[-3][-1] = f"{took:.0f} ({len(tried)} plans)"
        print(f"\n{title}: {flops / args.batch / 1e12:.1f} TFLOP per sequence (forward + backward), sequence "
              f"{seq or config['n_positions']}")
        print(format_table(["devices", "layout", "plan", "step ms", "MFU %", "bubble %", "GB/dev",
                            "solve s"], rows))


def anchors(args) -> None:
    from tilegraph.frontends.config import gpt
    from tilegraph.passes.cost.collectives import Mesh
    from tilegraph.passes.cost.hardware import hardware
    from tilegraph.passes.parallel_degrees import Layout, degrees, mfu, model_flops, recompute_tag
    from tilegraph.passes.shard import plan

    hw = hardware("a100")
    rows = []
    for name, heads, hidden, layers, t, p, gpus, reported in ANCHORS:
        model = gpt(layers, hidden, heads, seq=2048, vocab=51200)
        sizes = {"B": 512}
        d = gpus // t // p
        shape, only = ((d, t), tensor_layout(1, 0)) if t > 1 else ((d,), data_parallel)
        pl = plan(model.module, Mesh(shape, hw), sizes=sizes, only=only, runner_up=False, recompute="always")
        s, v, h, l_ = 2048, 51200, hidden, layers
        paper_flops = 96 * 512 * s * l_ * h * h * (1 + s / (6 * h) + v / (16 * l_ * h))
        lay = Layout(pl, p, 1, degrees(pl, p))
        rows.append([name, gpus, f"t{t} p{p} d{d}", f"zero{pl.zero}{recompute_tag(pl)}",
                     f"{pl.time:.2f}", f"{paper_flops / pl.time / gpus / 1e12:.0f}", reported,
                     f"{paper_flops / pl.time / gpus / 1e12 / reported:.2f}",
                     f"{100 * mfu(lay, model_flops(model.module, sizes), gpus):.0f}"])
    print(f"\nAnchors: Megatron-LM (SC21, Table 1) on A100 ({hw.peak_flops['bf16'] / 1e12:.0f} TFLOP/s bf16), "
          f"the paper's layout priced here")
    print(format_table(["model", "GPUs", "layout", "plan chose", "step s", "predicted TFLOP/s/GPU",
                        "reported", "predicted / reported", "MFU %"], rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", default="training", choices=("training", "one-axis"))
    ap.add_argument("--devices", default=None, help="device counts (default 8,16,64; one-axis: 1,2,4,8)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 256; one-axis: 8)")
    ap.add_argument("--inference", action="store_true", help="one-axis: a forward pass instead of a training step")
    ap.add_argument("--no-anchors", action="store_true")
    args = ap.parse_args(argv)
    print("\n".join(machine_lines()))
    if args.table == "training":
        args.devices, args.batch = args.devices or "8,16,64", args.batch or 256
        training_table(args)
        if not args.no_anchors:
            anchors(args)
        return 0
    args.devices, args.batch = args.devices or "1,2,4,8", args.batch or 8

    from tilegraph.passes.cost.collectives import Mesh
    from tilegraph.passes.cost.hardware import hardware
    from tilegraph.passes.shard import LayoutError, ShardError, plan
    from tests.models import GPT2_PADDED_VOCAB, gpt_graph

    hw = hardware("h100")
    print(f"target: {hw.name} ({hw.memory_bytes / 1e9:.0f} GB, NVLink {hw.links['nvlink'].beta / 1e9:.0f} GB/s "
          f"per direction), {'forward pass' if args.inference else 'training step'}, batch {args.batch}")
    for title, cfg in MODELS.items():
        model = gpt_graph(cfg["layers"], cfg["d_model"], cfg["heads"], seq=cfg["seq"], vocab=GPT2_PADDED_VOCAB)
        sizes = {"B": args.batch}
        rows = []
        for n in (int(d) for d in args.devices.split(",")):
            mesh = Mesh((n,), hw)
            results = {}
            for name, only in (("ilp", None), ("data", data_parallel), ("megatron", megatron)):
                t0 = time.perf_counter()
                try:
                    results[name] = (plan(model.module, mesh, sizes=sizes, training=not args.inference, only=only),
                                     time.perf_counter() - t0)
                except LayoutError:  # e.g. 12 heads do not split 8 ways
                    results[name] = ("n/a", time.perf_counter() - t0)
                except ShardError:  # over the memory budget
                    results[name] = ("no fit", time.perf_counter() - t0)

            def ms(name):
                p = results[name][0]
                return p if isinstance(p, str) else f"{p.time * 1e3:.2f}"

            ilp = results["ilp"][0]
            ilp = None if isinstance(ilp, str) else ilp
            hand = [results[k][0].time for k in ("data", "megatron") if not isinstance(results[k][0], str)]
            ratio = f"{min(hand) / ilp.time:.3f}" if ilp is not None and hand else "-"
            rows.append([n, ms("ilp"), ms("data"), ms("megatron"), ratio,
                         (describe(ilp) if n > 1 else "one device") if ilp else "-",
                         f"{100 * ilp.comm / ilp.time:.1f}" if ilp else "-",
                         f"{ilp.memory / 1e9:.1f}" if ilp else "-", f"{results['ilp'][1]:.2f}"])
        print(f"\n{title}: {cfg['layers']} layers, hidden {cfg['d_model']}, {cfg['heads']} heads, "
              f"sequence {cfg['seq']}, vocabulary {GPT2_PADDED_VOCAB}")
        print(format_table(["devices", "ilp ms", "data ms", "megatron ms", "best hand / ilp", "ilp plan",
                            "ilp comm %", "ilp GB/dev", "solve s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
