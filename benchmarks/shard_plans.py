"""Sharding plans for GPT-shaped models on 1-8 H100s: the `shard` planner's integer program
against two hand layouts, priced by the same cost model in the same run.

    python benchmarks/shard_plans.py [--devices 1,2,4,8] [--batch 8] [--inference]

Models (tests/models.py `gpt_graph`, weights as zero-strided views: cost only, no memory):
  GPT-2 small  12 layers, hidden 768, 12 heads, vocabulary 50304 (padded), sequence 1024
  GPT 1.3B     24 layers, hidden 2048, 16 heads, vocabulary 50304, sequence 2048
                (GPT-Neo 1.3B / Megatron-LM's 1.3B configuration)

For each device count, one training step of `--batch` sequences (predicted by
passes/cost: compute per device, collectives on NVLink, memory per device):
  ilp        the planner's choice (passes/shard.py)
  data       pure data parallelism: every matmul and attention split by batch, weights
             replicated (gradients all-reduced)
  megatron   Megatron-LM's tensor parallelism: Q/K/V, fc1 and the LM head split by columns,
             the output projection and fc2 by rows, attention by heads, the rest replicated
             as the solver finds cheapest around that
and the ratio of the best hand layout's time to the planner's (>= 1: the planner is
at least as good), and the planner's solve time (wall clock, this machine).
"no fit": over 80 GB per device (every intermediate is kept for the backward pass: no
activation recomputation); "n/a": the layout does not divide (GPT-2's 12 heads on 8).
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
COLUMN = ("attn.wq", "attn.wk", "attn.wv", "mlp.fc1", "lm_head")
ROW = ("attn.wo", "mlp.fc2")
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="1,2,4,8", help="device counts (one mesh axis, NVLink)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (global batch)")
    ap.add_argument("--inference", action="store_true", help="a forward pass instead of a training step")
    args = ap.parse_args(argv)

    from tilegraph.passes.cost.collectives import Mesh
    from tilegraph.passes.cost.hardware import hardware
    from tilegraph.passes.shard import LayoutError, ShardError, plan
    from tests.models import GPT2_PADDED_VOCAB, gpt_graph

    hw = hardware("h100")
    print("\n".join(machine_lines()))
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
