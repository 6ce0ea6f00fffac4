"""Converters: RNN, GRU and LSTM, unrolled over the static sequence length."""

from __future__ import annotations

from typing import Callable

import numpy as np

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.node import _conv
from tilegraph.ir import decompositions as D


# --- RNN, GRU, LSTM: unrolled over the (static) sequence length ---

# Activation names of the recurrent ops' `activations` attribute -> (f(n, x, alpha, beta), default alpha,
# default beta); the defaults are those of the ONNX operators of the same name, None where it takes none.
RNN_ACTIVATIONS = {
    "tanh": (lambda n, x, a, b: n.op("tanh", x), None, None),
    "sigmoid": (lambda n, x, a, b: n.op("sigmoid", x), None, None),
    "relu": (lambda n, x, a, b: n.op("relu", x), None, None),
    "softsign": (lambda n, x, a, b: n.op("div", x, n.op("add", n.op("abs", x), 1)), None, None),
    "affine": (lambda n, x, a, b: n.op("add", n.op("mul", x, a), b), 1.0, 0.0),
    "leakyrelu": (lambda n, x, a, b: n.op("where", n.op("lt", x, 0), n.op("mul", x, a), x), 0.01, None),
    "hardsigmoid": (lambda n, x, a, b: D.hard_sigmoid(n.emit, x, a, b), 0.2, 0.5),
    "scaledtanh": (lambda n, x, a, b: n.op("mul", n.op("tanh", n.op("mul", x, b)), a), 1.0, 1.0),
}
# The gates of each op (ONNX order within W, R, B) and its default activations per direction.
RNN_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
RNN_DEFAULT_ACTIVATIONS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}


def _rnn_activations(n, directions: int) -> list[list[Callable]]:
    """Per direction, the activation functions (f, g, h); alphas and betas are consumed in order."""
    names = n.attr("activations", RNN_DEFAULT_ACTIVATIONS[n.op_type] * directions)
    alphas, betas = list(n.attr("activation_alpha", [])), list(n.attr("activation_beta", []))
    acts = []
    for name in names:
        if name.lower() not in RNN_ACTIVATIONS:
            raise FrontendError(f"activation '{name}' is not supported (supported: {sorted(RNN_ACTIVATIONS)})")
        fn, a, b = RNN_ACTIVATIONS[name.lower()]
        a = alphas.pop(0) if a is not None and alphas else a
        b = betas.pop(0) if b is not None and betas else b
        acts.append(lambda x, fn=fn, a=a, b=b: fn(n, x, a, b))
    per = len(RNN_DEFAULT_ACTIVATIONS[n.op_type])
    if len(acts) != per * directions:
        raise FrontendError(f"{len(acts)} activations for {directions} direction(s) of {per}")
    return [acts[d * per:(d + 1) * per] for d in range(directions)]


def _rnn_step(n, kind, acts, xw, h, c, r, rb, p, clip):
    """One time step: x's gate inputs xw (B, G*H, input bias in), states h (and c) -> new h (and c)."""
    hidden = n.shape(h)[-1]

    def gate(v, g):
        return n.slice(v, n.rank(v) - 1, g * hidden, (g + 1) * hidden)

    def clipped(v):
        return v if clip is None else n.op("min", n.op("max", v, -clip), clip)

    if kind == "RNN":
        return acts[0](clipped(n.op("add", xw, n.op("add", n.op("matmul", h, r), rb)))), None
    if kind == "LSTM":
        gates = n.op("add", xw, n.op("add", n.op("matmul", h, r), rb))
        i, o, f, g = (gate(gates, k) for k in range(4))
        pi, po, pf = (None if p is None else n.slice(p, 0, k * hidden, (k + 1) * hidden) for k in range(3))
        i = acts[0](clipped(i if p is None else n.op("add", i, n.op("mul", pi, c))))
        f = acts[0](clipped(f if p is None else n.op("add", f, n.op("mul", pf, c))))
        c = n.op("add", n.op("mul", f, c), n.op("mul", i, acts[1](clipped(g))))
        o = acts[0](clipped(o if p is None else n.op("add", o, n.op("mul", po, c))))
        return n.op("mul", o, acts[2](c)), c
    # GRU: gates z, r, h; the hidden gate reads r * h (or r * (h R_h + Rb_h) with linear_before_reset)
    rz, rr, rh = (n.slice(r, 1, k * hidden, (k + 1) * hidden) for k in range(3))
    bz, br, bh = (gate(rb, k) for k in range(3))
    z = acts[0](clipped(n.op("add", gate(xw, 0), n.op("add", n.op("matmul", h, rz), bz))))
    rt = acts[0](clipped(n.op("add", gate(xw, 1), n.op("add", n.op("matmul", h, rr), br))))
    if n.attr("linear_before_reset", 0):
        inner = n.op("mul", rt, n.op("add", n.op("matmul", h, rh), bh))
    else:
        inner = n.op("add", n.op("matmul", n.op("mul", rt, h), rh), bh)
    ht = acts[1](clipped(n.op("add", gate(xw, 2), inner)))
    return n.op("add", n.op("mul", n.op("sub", 1, z), ht), n.op("mul", z, h)), None


def time_major(n, layout: int, x, h0, c0):
    """X as (steps, batch, input) and the initial states as (directions, batch, hidden), from
    the node's layout (1: batch first)."""
    if not layout:
        return x, h0, c0
    x, h0, c0 = (None if v is None else n.transpose(v, (1, 0, 2)) for v in (x, h0, c0))
    return x, h0, c0


def rnn_outputs(n, kind: str, ys: list, hs: list, cs: list, layout: int):
    """ONNX's Y, Y_h (and Y_c) from each direction's sequence, last hidden and last cell
    state ((steps, 1, batch, hidden) and (1, batch, hidden) each), in the node's layout."""
    y = ys[0] if len(ys) == 1 else n.op("concat", *ys, axis=1)
    yh = hs[0] if len(hs) == 1 else n.op("concat", *hs, axis=0)
    yc = None if kind != "LSTM" else (cs[0] if len(cs) == 1 else n.op("concat", *cs, axis=0))
    if layout:
        y = n.transpose(y, (2, 0, 1, 3))
        yh = n.transpose(yh, (1, 0, 2))
        yc = None if yc is None else n.transpose(yc, (1, 0, 2))
    return (y, yh, yc) if kind == "LSTM" else (y, yh)


@_conv("RNN", "GRU", "LSTM")
def _recurrent(n):
    kind = n.op_type
    x, w, r = n.x(0), n.x(1), n.x(2)
    b, lens, h0 = n.opt(3), n.opt(4), n.opt(5)
    c0, p = (n.opt(6), n.opt(7)) if kind == "LSTM" else (None, None)
    layout = n.attr("layout", 0)
    x, h0, c0 = time_major(n, layout, x, h0, c0)
    steps, batch, _ = n.shape(x)
    if not isinstance(steps, int):
        raise FrontendError(f"{kind} is unrolled over the sequence: its length must be static, got {steps}")
    if lens is not None and set(n.static(4).reshape(-1).tolist()) - {steps}:
        raise FrontendError("sequence_lens shorter than the sequence are not supported")
    if n.attr("input_forget", 0):
        raise FrontendError("input_forget=1 is not supported")
    directions, gh = n.shape(w)[0], n.shape(w)[1]
    hidden = gh // RNN_GATES[kind]
    direction = n.attr("direction", "forward")
    if (direction == "bidirectional") != (directions == 2):
        raise FrontendError(f"direction '{direction}' does not fit W {n.info(w)}")
    clip = n.attrs.get("clip")
    zeros = n.broadcast(n.const(0, n.dtype(x)).reshape(1, 1), (batch, hidden))
    ys, hs, cs = [], [], []
    for d, acts in enumerate(_rnn_activations(n, directions)):
        wd, rd = (n.reshape(n.slice(v, 0, d, d + 1), n.shape(v)[1:]) for v in (w, r))
        xw = n.op("matmul", x, n.transpose(wd, (1, 0)))  # (T, B, G*H), all steps at once
        rb = n.const(np.zeros(gh), n.dtype(x))  # the recurrence's bias; the input's joins xw
        if b is not None:
            bd = n.reshape(n.slice(b, 0, d, d + 1), (2 * gh,))
            xw = n.op("add", xw, n.slice(bd, 0, 0, gh))
            rb = n.slice(bd, 0, gh, 2 * gh)
        h = zeros if h0 is None else n.reshape(n.slice(h0, 0, d, d + 1), (batch, hidden))
        c = zeros if c0 is None else n.reshape(n.slice(c0, 0, d, d + 1), (batch, hidden))
        pd = None if p is None else n.reshape(n.slice(p, 0, d, d + 1), (3 * hidden,))
        order = range(steps - 1, -1, -1) if direction == "reverse" or d == 1 else range(steps)
        outs = {}
        rt = n.transpose(rd, (1, 0))
        for t in order:
            xt = n.reshape(n.slice(xw, 0, t, t + 1), (batch, gh))
            h, c = _rnn_step(n, kind, acts, xt, h, c if kind == "LSTM" else None, rt, rb, pd, clip)
            outs[t] = n.reshape(h, (1, 1, batch, hidden))
        ys.append(n.op("concat", *[outs[t] for t in range(steps)], axis=0) if steps > 1 else outs[0])
        hs.append(n.reshape(h, (1, batch, hidden)))
        cs.append(None if c is None else n.reshape(c, (1, batch, hidden)))
    return rnn_outputs(n, kind, ys, hs, cs, layout)
