"""A training step as one compiled program: forward, loss, backward and the optimizer update.

    step = tilegraph.train_step(module, "cross_entropy", tilegraph.train.AdamW(lr=1e-3, weight_decay=0.1),
                                example_inputs=(ids,), target="c", clip_norm=1.0)
    loss = step(ids, targets=next_ids)       # weights and optimizer state updated in place
    step.weights["fc.weight"]                # the current weights (the arrays the step updates)

The step is one tg function (`step.model`):

    @forward(inputs..., targets, <param>..., <optimizer state>..., lr, step)
        -> (loss, <param>..., <optimizer state>...)

the backward made by `ir/autodiff.py`, the optimizer written in tg ops here. Each weight and
state input is donated to the result of its name (`Model.aliases`, the `tg.aliases` argument
attribute: XLA's input/output aliasing, as generation's KV
cache uses it): the step writes that result into the input's array, so the arrays in
`step.weights` and `step.state` are the same objects from call to call. The C backend's
optimizer loop writes each update where the weight lies (backends/c/groups.py `_in_place`);
NumPy computes it into a new array, which the step copies over.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from xdsl.ir import SSAValue

from tilegraph.frontends import DROPOUT_SEED
from tilegraph.ir import dtypes
from tilegraph.ir.autodiff import float_weights, set_signature, value_and_grad, vjp
from tilegraph.ir.dialect import TgOp
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.model import Model, WeightStore, ssa_hint
from tilegraph.ir.shapes import info_of, tensor_type
from tilegraph.ir.vjp import Backward, one_hot
from tilegraph.ir.ops import Op

LOSSES = ("cross_entropy", "mean")


class TrainError(TilegraphError):
    """A training step that cannot be built as asked; the message says why."""


@dataclass(frozen=True)
class SGD:
    """torch.optim.SGD: momentum (buffers start at the first gradient), coupled weight decay, Nesterov."""

    lr: float = 1e-2
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def state_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()


@dataclass(frozen=True)
class AdamW:
    """torch.optim.AdamW: decoupled weight decay, bias-corrected moments, as torch computes them."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")


def weights_to_inputs(model: Model, names: Sequence[str]) -> Model:
    """`model` with the weights `names` turned into function inputs of the same names (appended)."""
    model = model.clone()
    block = model.func.body.block
    in_names = model.input_names
    for name in names:
        w = np.asarray(model.weights[name])
        arg = block.insert_arg(tensor_type(dtypes.dtype_name(w.dtype), tuple(w.shape)), len(block.args))
        arg.name_hint = ssa_hint(name)
        for op in [op for op in block.ops if isinstance(op, TgOp) and op.op_name == Op.weight and op.attr("name") == name]:
            op.results[0].replace_all_uses_with(arg)
            block.erase_op(op)
        in_names.append(name)
    store = WeightStore({k: v for k, v in model.weights.items() if k not in set(names)})
    model = Model(model.module, store)
    ret = block.last_op
    return set_signature(model, in_names, list(ret.operands), model.output_names)


def _with_loss(model: Model, loss: str) -> Model:
    """`model` (its first output the logits) returning the loss: `targets` is a new input."""
    model = model.clone()
    block = model.func.body.block
    ret = block.last_op
    logits = ret.operands[0]
    t = info_of(logits.type)
    b = Backward()
    in_names = model.input_names
    if loss == "mean":
        value = b("reduce_mean", logits, axes=tuple(range(t.rank)))
    elif loss == "cross_entropy":
        if t.rank < 1 or not dtypes.is_float(t.dtype):
            raise TrainError(f"cross_entropy needs float logits (..., classes), got {t}")
        targets = block.insert_arg(tensor_type("i64", t.shape[:-1]), len(block.args))
        targets.name_hint = "targets"
        in_names.append("targets")
        value = cross_entropy(b, logits, targets)
    else:
        raise TrainError(f"unknown loss '{loss}'; tilegraph trains with {', '.join(LOSSES)}")
    block.insert_ops_before(b.ops, ret)
    return set_signature(model, in_names, [value], ["loss"])


def cross_entropy(b: Backward, logits: SSAValue, targets: SSAValue) -> SSAValue:
    """mean over rows of logsumexp(logits) - logits[target] (torch's F.cross_entropy, mean reduction)."""
    t = info_of(logits.type)
    axis = t.rank - 1
    m = b("reduce_max", logits, axes=(axis,), keepdims=True)
    shifted = b("sub", logits, m)
    lse = b("log", b.sum(b("exp", shifted), (axis,), keepdims=True))
    picked = b("gather_elements", shifted, b.reshape(targets, tuple(t.shape[:-1]) + (1,)), axis=axis)
    return b("reduce_mean", b("sub", lse, picked), axes=tuple(range(t.rank)))


def cross_entropy_and_grad(b: Backward, logits: SSAValue, targets: SSAValue) -> tuple[SSAValue, SSAValue]:
    """(loss, d loss / d logits) of torch's mean cross-entropy, the gradient written by hand:
    (softmax(logits) - one_hot(targets)) / rows, softmax recomputed from the logits and each row's
    logsumexp (one pass, one exp per logit). Autodiff of `cross_entropy` would differentiate the
    max shift too, whose gradient is exactly zero (the loss does not depend on it), at two more
    passes and two more exps per logit: over GPT-2's 50257-wide rows the largest cost of the loss.
    The shift is a constant here, as JAX's logsumexp stops its gradient."""
    t = info_of(logits.type)
    axis = t.rank - 1
    rows = 1
    for d in t.shape[:-1]:
        rows *= d
    m = b("reduce_max", logits, axes=(axis,), keepdims=True)
    lse = b("add", b("log", b.sum(b("exp", b("sub", logits, m)), (axis,), keepdims=True)), m)
    index = b.reshape(targets, tuple(t.shape[:-1]) + (1,))
    picked = b("gather_elements", logits, index, axis=axis)
    loss = b("reduce_mean", b("sub", lse, picked), axes=tuple(range(t.rank)))
    softmax = b("exp", b("sub", logits, b.broadcast_to(lse, t.shape)))
    dlogits = b("mul", b("sub", softmax, one_hot(b, index, t, axis)), b.const(1.0 / rows, t.dtype))
    return loss, dlogits


def build_gradients(model: Model, loss: str, params: Sequence[str]) -> Model:
    """@forward(inputs..., targets, <param>...) -> (loss, grad_<param>...): the step's forward and backward."""
    missing = [p for p in params if p not in model.weights]
    if missing:
        raise TrainError(f"no weight named {', '.join(missing)} to train")
    t = info_of(model.func.body.block.last_op.operands[0].type)
    if loss != "cross_entropy" or not all(isinstance(d, int) for d in t.shape) or not dtypes.is_float(t.dtype):
        return value_and_grad(weights_to_inputs(_with_loss(model, loss), params), wrt=list(params))
    # The model's VJP with the logits' cotangent as an input, then that input replaced by
    # cross-entropy's own gradient, computed right after the logits.
    first = model.clone()
    ret = first.func.body.block.last_op
    first = set_signature(first, first.input_names, [ret.operands[0]], first.output_names[:1])
    m = vjp(weights_to_inputs(first, params), wrt=list(params))
    block = m.func.body.block
    logits, *grads = block.last_op.operands
    cotangent = block.args[-1]
    in_names = m.input_names[:-1]
    at = len(model.input_names)
    targets = block.insert_arg(tensor_type("i64", t.shape[:-1]), at)
    targets.name_hint = "targets"
    in_names.insert(at, "targets")
    b = Backward()
    value, dlogits = cross_entropy_and_grad(b, logits, targets)
    if isinstance(logits.owner, TgOp):
        block.insert_ops_after(b.ops, logits.owner)
    else:  # the logits are an input: nothing to differentiate but the loss itself
        block.insert_ops_before(b.ops, block.first_op)
    cotangent.replace_all_uses_with(dlogits)
    block.erase_arg(cotangent)
    return set_signature(m, in_names, [value, *grads], ["loss"] + ["grad_" + p for p in params])


def build_step(model: Model, loss: str, optimizer: SGD | AdamW, params: Sequence[str],
               clip_norm: float | None = None) -> Model:
    """The step's tg function (see the module docstring)."""
    m = build_gradients(model, loss, params)
    loss_value, *grads = m.func.body.block.last_op.operands
    return _with_update(m, params, grads, optimizer, clip_norm, [("loss", loss_value)])


def build_update(params: dict[str, np.ndarray], optimizer: SGD | AdamW, clip_norm: float | None = None) -> Model:
    """@forward(<param>..., grad_<param>..., <optimizer state>..., lr, step) -> (<param>..., <state>...):
    the optimizer alone, for gradients reduced between the backward and the update (data parallelism)."""
    from tilegraph.ir import Graph

    g = Graph()
    for name, w in params.items():
        g.input(name, tuple(w.shape), dtypes.dtype_name(w.dtype))
    grads = [g.input("grad_" + name, tuple(w.shape), dtypes.dtype_name(w.dtype)) for name, w in params.items()]
    m = g.build(grads[0])
    return _with_update(m, list(params), [t.value for t in grads], optimizer, clip_norm, [])


def _with_update(m: Model, params: Sequence[str], grads: list[SSAValue], optimizer: SGD | AdamW,
                 clip_norm: float | None, leading: list[tuple[str, SSAValue]]) -> Model:
    """`m` (its arguments include the params by name) returning `leading`, then each param updated
    from its gradient and its optimizer state (new inputs: the state, lr and step), each donated."""
    block = m.func.body.block
    ret = block.last_op
    in_names = m.input_names
    b = Backward()
    args = {name: a for name, a in zip(in_names, block.args)}

    def scalar_input(name):
        arg = block.insert_arg(tensor_type("f32", ()), len(block.args))
        arg.name_hint = name
        in_names.append(name)
        return arg

    lr = scalar_input("lr")
    step = scalar_input("step")
    if clip_norm is not None:
        # torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), capped at 1
        total = None
        for g in grads:
            sq = b.sum(b("mul", g, g), range(info_of(g.type).rank))
            total = sq if total is None else b("add", total, sq)
        norm = b("sqrt", total)
        coef = b("min", b("div", b.const(clip_norm, "f32"), b("add", norm, b.const(1e-6, "f32"))), b.const(1.0, "f32"))
        grads = [b("mul", g, coef) for g in grads]
    results, names = [v for _, v in leading], [n for n, _ in leading]
    for name, g in zip(params, grads):
        p = args[name]
        dt = info_of(p.type).dtype
        lr_p = b("cast", lr, to=dt) if dt != "f32" else lr
        state = {}
        for s in optimizer.state_names():
            arg = block.insert_arg(p.type, len(block.args))
            arg.name_hint = ssa_hint(f"{s}.{name}")
            in_names.append(f"{s}.{name}")
            state[s] = arg
        c = lambda v, dt=dt: b.const(v, dt)  # noqa: E731
        new_state = {}
        if isinstance(optimizer, SGD):
            if optimizer.weight_decay:
                g = b("add", g, b("mul", p, c(optimizer.weight_decay)))
            if optimizer.momentum:
                buf = b("add", b("mul", state["momentum"], c(optimizer.momentum)), g)  # zero buffers: the first is g
                new_state["momentum"] = buf
                g = b("add", g, b("mul", buf, c(optimizer.momentum))) if optimizer.nesterov else buf
            new_p = b("sub", p, b("mul", g, lr_p))
        else:
            b1, b2 = optimizer.betas
            stepc = b("cast", step, to=dt) if dt != "f32" else step
            decayed = b("mul", p, b("sub", c(1.0), b("mul", lr_p, c(optimizer.weight_decay))))
            m1 = b("add", b("mul", state["exp_avg"], c(b1)), b("mul", g, c(1 - b1)))
            m2 = b("add", b("mul", state["exp_avg_sq"], c(b2)), b("mul", b("mul", g, g), c(1 - b2)))
            bc1 = b("sub", c(1.0), b("pow", c(b1), stepc))
            bc2 = b("sub", c(1.0), b("pow", c(b2), stepc))
            denom = b("add", b("div", b("sqrt", m2), b("sqrt", bc2)), c(optimizer.eps))
            new_p = b("sub", decayed, b("mul", b("div", m1, denom), b("div", lr_p, bc1)))
            new_state = {"exp_avg": m1, "exp_avg_sq": m2}
        results.append(new_p)
        names.append(name)
        for s in optimizer.state_names():
            results.append(new_state[s])
            names.append(f"{s}.{name}")
    block.insert_ops_before(b.ops, ret)
    return set_signature(m, in_names, results, names, aliases={n: n for n in names[len(leading):]})


class TrainStep:
    """A compiled training step holding the weights and optimizer state it updates in place."""

    def __init__(self, step_model: Model, compiled: Any, params: dict[str, np.ndarray], optimizer, seed: int = 0):
        self.model = step_model
        self.seed = seed
        self.compiled = compiled
        self.optimizer = optimizer
        self.weights = {k: np.array(v, copy=True) for k, v in params.items()}
        self.state = {f"{s}.{k}": np.zeros_like(v) for k, v in self.weights.items() for s in optimizer.state_names()}
        self.steps = 0
        names = step_model.input_names
        self._updates = {r: names[i] for i, r in step_model.aliases.items()}
        self._data = names[:names.index("lr")]
        self._data = [n for n in self._data if n not in self.weights and n not in self.state and n != DROPOUT_SEED]

    def __call__(self, *inputs: Any, targets: Any = None, lr: float | None = None) -> float:
        self.steps += 1
        arrays = {n: _numpy(a) for n, a in zip(self._data, list(inputs) + ([targets] if targets is not None else []))}
        if len(arrays) != len(self._data):
            raise TrainError(f"the step takes {', '.join(self._data)}; got {len(arrays)} arrays")
        rate = self.optimizer.lr if lr is None else lr
        feed = {**arrays, **self.weights, **self.state, "lr": np.float32(rate), "step": np.float32(self.steps),
                DROPOUT_SEED: np.int64(self.seed + self.steps)}
        feed = {n: feed[n] for n in self.model.input_names}
        outs = self.compiled.run(**feed)
        _write_back(self._updates, outs, self.weights, self.state)
        return float(outs[0])


def _write_back(updates: dict[int, str], outs: list, weights: dict, state: dict) -> None:
    """Each donated result into the array held under its name, where the backend computed it
    elsewhere (NumPy); C writes it where it lies and returns that array itself."""
    for i, name in updates.items():
        held = weights[name] if name in weights else state[name]
        if outs[i] is not held:
            np.copyto(held, outs[i])


def _numpy(a: Any) -> np.ndarray:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    return np.asarray(a)


# Targets on which attention spelled out as matmul, softmax, matmul (HF BERT's eager attention)
# is folded into tg.attention before autodiff: its VJP is then one tg.attention_grad, which the C
# backend runs as attention_backward.c's kernel (the probabilities recomputed per head in cache,
# its products register-blocked), where the chain's own VJP is four batched GEMMs and the
# softmax's backward loops over scores written to memory (benchmarks/train_speed.py: MiniLM's step).
# The NumPy reference differentiates the chain as written.
FOLD_ATTENTION_TARGETS = ("c",)


def _fold_attention(imported: Model, target: str) -> Model:
    """`imported` with its spelled-out attention folded where `target` differentiates it so."""
    if target not in FOLD_ATTENTION_TARGETS:
        return imported
    from tilegraph.passes.attention import FoldAttention
    from tilegraph.passes.registry import run_pipeline

    return run_pipeline(imported, [FoldAttention()])


def train_step(model: Any, loss: str = "cross_entropy", optimizer: SGD | AdamW | None = None, *,
               example_inputs: Sequence[Any] | None = None, params: Sequence[str] | None = None,
               clip_norm: float | None = None, target: str = "numpy", pipeline: Any = None, seed: int = 0,
               **options) -> TrainStep:
    """Compile one training step of `model` (anything `tilegraph.import_model` reads; its first
    output the logits, or the value `loss="mean"` averages). params: the weights trained (default:
    a torch module's parameters, else every float weight). seed: dropout's masks at step n are
    drawn from seed + n (tg.dropout: the same seed gives the same masks). options go to
    tilegraph.compile: on target="c", `precision="bf16"` is mixed-precision training (every GEMM
    multiplies in bf16 on the processor's bf16 units, accumulating in f32; the weights, the
    optimizer's state and its update stay f32, the master copy; bf16 has f32's exponent range,
    so no loss scaling)."""
    import tilegraph

    optimizer = optimizer or AdamW()
    if not isinstance(optimizer, (SGD, AdamW)):
        raise TrainError(f"optimizer must be tilegraph.train.SGD or AdamW, got {type(optimizer).__name__}")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module) and example_inputs is not None:
        from tilegraph.frontends.torch_export import from_torch

        # nn.Dropout modules in training mode drop, as in torch's training: tg.dropout, its
        # seed an input the step feeds (`seed` + the step's number)
        imported = from_torch(model, tuple(example_inputs), dropout=True)
    else:
        imported = tilegraph.import_model(model, example_inputs)
    if DROPOUT_SEED in imported.weights:
        imported = weights_to_inputs(imported, [DROPOUT_SEED])
    params = list(params) if params is not None else _default_params(model, imported)
    step_model = build_step(_fold_attention(imported, target), loss, optimizer, list(params), clip_norm)
    initial = {name: np.asarray(imported.weights[name]) for name in params}
    compiled = tilegraph.compile(step_model, target=target, pipeline=pipeline, **options)
    return TrainStep(step_model, compiled, initial, optimizer, seed)


# --- data parallelism: N local processes, gradients all-reduced between backward and update ---


class DataParallelStep:
    """One rank's training step under data parallelism: its slice of the batch forward and
    backward (one compiled module), the gradients and loss averaged over the ranks with one
    torch.distributed all-reduce, then the optimizer (a second compiled module) on the same
    averaged gradients on every rank, so the replicas stay identical (DDP's scheme; ZeRO's
    sharded states are not built)."""

    def __init__(self, grads: Any, update: Any, params: dict[str, np.ndarray], optimizer, world: int):
        self.grads, self.update, self.optimizer, self.world = grads, update, optimizer, world
        self.weights = {k: np.array(v, copy=True) for k, v in params.items()}
        self.state = {f"{s}.{k}": np.zeros_like(v) for k, v in self.weights.items() for s in optimizer.state_names()}
        self.steps = 0
        self._data = [n for n in grads.model.input_names if n not in self.weights]
        names = update.model.input_names
        self._updates = {r: names[i] for i, r in update.model.aliases.items()}

    def __call__(self, *inputs: Any, targets: Any = None, lr: float | None = None) -> float:
        import torch
        import torch.distributed as dist

        self.steps += 1
        arrays = dict(zip(self._data, [_numpy(a) for a in (*inputs, targets)]))
        loss, *grads = self.grads.run(**arrays, **self.weights)
        # torch-owned (torch.tensor copies): gloo's thread may release the last reference, and a
        # NumPy-owned buffer released there needs the GIL it does not hold
        packed = torch.tensor(np.concatenate([np.ravel(g).astype(np.float32) for g in grads] + [np.ravel(loss)]))
        dist.all_reduce(packed)  # one collective for every gradient: gloo's per-call cost dominates small tensors
        flat = packed.numpy() / self.world
        feed, at = {}, 0
        for name, w in self.weights.items():
            feed["grad_" + name] = flat[at:at + w.size].reshape(w.shape).astype(w.dtype)
            at += w.size
        rate = self.optimizer.lr if lr is None else lr
        outs = self.update.run(**self.weights, **feed, **self.state, lr=np.float32(rate), step=np.float32(self.steps))
        _write_back(self._updates, outs, self.weights, self.state)
        return float(flat[-1])


def data_parallel_step(model: Any, loss: str = "cross_entropy", optimizer: SGD | AdamW | None = None, *,
                       example_inputs: Sequence[Any], world: int, params: Sequence[str] | None = None,
                       clip_norm: float | None = None, target: str = "numpy", **options) -> DataParallelStep:
    """This rank's DataParallelStep (call inside a process of an initialised torch.distributed group of
    `world` ranks); example_inputs: this rank's slice of a batch."""
    import tilegraph

    optimizer = optimizer or AdamW()
    imported = tilegraph.import_model(model, example_inputs)
    params = list(params) if params is not None else _default_params(model, imported)
    initial = {name: np.asarray(imported.weights[name]) for name in params}
    grads = tilegraph.compile(build_gradients(_fold_attention(imported, target), loss, params), target=target, **options)
    update = tilegraph.compile(build_update(initial, optimizer, clip_norm), target=target, **options)
    return DataParallelStep(grads, update, initial, optimizer, world)


def _default_params(model: Any, imported: Model) -> list[str]:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return [n for n, _ in model.named_parameters() if n in imported.weights]
    return float_weights(imported)


def train_data_parallel(make_model, batches: Sequence[tuple[Any, Any]], world: int, optimizer: SGD | AdamW,
                        clip_norm: float | None = None, target: str = "numpy", pipeline: Any = None,
                        timeout_s: float = 900.0) -> dict:
    """Train `make_model()` (a picklable function returning a torch module; every rank calls it, so
    it must give the same initial weights) on `batches` [(inputs, targets)] with data parallelism over
    `world` local processes joined by gloo, each taking its contiguous 1/world of every batch's rows
    (pipeline: the passes each process compiles its modules with; None: the default).
    Returns {"losses": the averaged loss per step, "seconds": rank 0's time per step}."""
    import tempfile

    import torch.multiprocessing as mp

    from tilegraph.backends.distributed import _free_port

    if any(int(x.shape[0]) % world for x, _ in batches):
        raise TrainError(f"every batch's rows must split evenly over {world} processes")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_data_parallel_worker, args=(world, _free_port(), make_model, list(batches), optimizer, clip_norm,
                                              target, pipeline, tmp, timeout_s), nprocs=world, join=True)
        with np.load(f"{tmp}/result.npz") as f:
            return {"losses": f["losses"].tolist(), "seconds": f["seconds"].tolist()}


def _data_parallel_worker(rank: int, world: int, port: int, make_model, batches, optimizer, clip_norm, target: str,
                          pipeline: Any, tmp: str, timeout_s: float) -> None:
    import time

    import torch.distributed as dist

    from tilegraph.backends.distributed import join_local_group

    join_local_group(rank, world, port, timeout_s)
    try:
        def mine(a):
            rows = a.shape[0] // world
            return a[rank * rows:(rank + 1) * rows]

        options = {"threads": 1} if target == "c" else {}
        step = data_parallel_step(make_model(), "cross_entropy", optimizer, example_inputs=(mine(batches[0][0]),),
                                  world=world, clip_norm=clip_norm, target=target, pipeline=pipeline, **options)
        losses, seconds = [], []
        for x, y in batches:
            t = time.perf_counter()
            losses.append(step(mine(x), targets=mine(y)))
            seconds.append(time.perf_counter() - t)
        if rank == 0:
            np.savez(f"{tmp}/result.npz", losses=np.array(losses), seconds=np.array(seconds))
    finally:
        dist.destroy_process_group()
