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
attribute: XLA's input/output aliasing, DESIGN.md "State across calls", as generation's KV
cache uses it): the step writes that result into the input's array, so the arrays in
`step.weights` and `step.state` are the same objects from call to call. The backends still
compute each updated value into a buffer of their own and the step copies it over (the
minimal version: no backend writes an optimizer's update where the input lies yet).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from xdsl.ir import SSAValue

from tilegraph.ir import dtypes
from tilegraph.ir.autodiff import float_weights, set_signature, value_and_grad
from tilegraph.ir.dialect import TgOp
from tilegraph.ir.errors import TilegraphError
from tilegraph.ir.model import Model, WeightStore, ssa_hint
from tilegraph.ir.shapes import info_of, tensor_type
from tilegraph.ir.vjp import Backward

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
        for op in [op for op in block.ops if isinstance(op, TgOp) and op.op_name == "weight" and op.attr("name") == name]:
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


def build_step(model: Model, loss: str, optimizer: SGD | AdamW, params: Sequence[str],
               clip_norm: float | None = None) -> Model:
    """The step's tg function (see the module docstring)."""
    missing = [p for p in params if p not in model.weights]
    if missing:
        raise TrainError(f"no weight named {', '.join(missing)} to train")
    m = weights_to_inputs(_with_loss(model, loss), params)
    m = value_and_grad(m, wrt=list(params))
    block = m.func.body.block
    ret = block.last_op
    loss_value, *grads = ret.operands
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
    results, names = [loss_value], ["loss"]
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
    return set_signature(m, in_names, results, names, aliases={n: n for n in names[1:]})


class TrainStep:
    """A compiled training step holding the weights and optimizer state it updates in place."""

    def __init__(self, step_model: Model, compiled: Any, params: dict[str, np.ndarray], optimizer):
        self.model = step_model
        self.compiled = compiled
        self.optimizer = optimizer
        self.weights = {k: np.array(v, copy=True) for k, v in params.items()}
        self.state = {f"{s}.{k}": np.zeros_like(v) for k, v in self.weights.items() for s in optimizer.state_names()}
        self.steps = 0
        names = step_model.input_names
        self._updates = {r: names[i] for i, r in step_model.aliases.items()}
        self._data = names[:names.index("lr")]
        self._data = [n for n in self._data if n not in self.weights and n not in self.state]

    def __call__(self, *inputs: Any, targets: Any = None, lr: float | None = None) -> float:
        self.steps += 1
        arrays = {n: _numpy(a) for n, a in zip(self._data, list(inputs) + ([targets] if targets is not None else []))}
        if len(arrays) != len(self._data):
            raise TrainError(f"the step takes {', '.join(self._data)}; got {len(arrays)} arrays")
        rate = self.optimizer.lr if lr is None else lr
        feed = {**arrays, **self.weights, **self.state, "lr": np.float32(rate), "step": np.float32(self.steps)}
        outs = self.compiled.run(**feed)
        for i, name in self._updates.items():
            np.copyto(self.weights[name] if name in self.weights else self.state[name], outs[i])
        return float(outs[0])


def _numpy(a: Any) -> np.ndarray:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def train_step(model: Any, loss: str = "cross_entropy", optimizer: SGD | AdamW | None = None, *,
               example_inputs: Sequence[Any] | None = None, params: Sequence[str] | None = None,
               clip_norm: float | None = None, target: str = "numpy", pipeline: Any = None, **options) -> TrainStep:
    """Compile one training step of `model` (anything `tilegraph.import_model` reads; its first
    output the logits, or the value `loss="mean"` averages). params: the weights trained (default:
    a torch module's parameters, else every float weight)."""
    import tilegraph

    optimizer = optimizer or AdamW()
    if not isinstance(optimizer, (SGD, AdamW)):
        raise TrainError(f"optimizer must be tilegraph.train.SGD or AdamW, got {type(optimizer).__name__}")
    imported = tilegraph.import_model(model, example_inputs)
    if params is None:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(model, torch.nn.Module):
            params = [n for n, _ in model.named_parameters() if n in imported.weights]
        else:
            params = float_weights(imported)
    step_model = build_step(imported, loss, optimizer, list(params), clip_norm)
    initial = {name: np.asarray(imported.weights[name]) for name in params}
    compiled = tilegraph.compile(step_model, target=target, pipeline=pipeline, **options)
    return TrainStep(step_model, compiled, initial, optimizer)
