"""Converters: the training optimizers (ai.onnx.preview.training), one update step."""

from __future__ import annotations

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.node import _conv


# --- the training optimizers (ai.onnx.preview.training), one update step ---

TRAINING = "ai.onnx.preview.training."


def _optimizer_groups(n, per: int) -> list[list]:
    """The (X, G, state...) tensors of each optimized tensor: inputs after R and T, grouped by kind."""
    rest = n.inputs[2:]
    k = len(rest) // per
    if k * per != len(rest) or not k:
        raise FrontendError(f"expects R, T and {per} tensors per optimized tensor, got {len(n.inputs)} inputs")
    return [[rest[j * k + i] for j in range(per)] for i in range(k)]


def _regularized(n, x, g):
    return n.op("add", n.op("mul", x, float(n.attr("norm_coefficient", 0.0))), g)


@_conv(TRAINING + "Adagrad")
def _adagrad(n):
    r, t = n.x(0), n.cast(n.x(1), n.dtype(n.x(0)))
    rate = n.op("div", r, n.op("add", n.op("mul", t, float(n.attr("decay_factor", 0.0))), 1.0))
    xs, hs = [], []
    for x, g, h in _optimizer_groups(n, 3):
        gr = _regularized(n, x, g)
        h_new = n.op("add", h, n.op("mul", gr, gr))
        step = n.op("div", n.op("mul", n.cast(rate, n.dtype(x)), gr),
                    n.op("add", n.op("sqrt", h_new), float(n.attr("epsilon", 0.0))))
        xs.append(n.op("sub", x, step))
        hs.append(h_new)
    return xs + hs


@_conv(TRAINING + "Adam")
def _adam(n):
    dt = n.dtype(n.x(0))
    r, t = n.x(0), n.cast(n.x(1), dt)
    alpha, beta = float(n.attr("alpha", 0.9)), float(n.attr("beta", 0.999))
    # r * sqrt(1 - beta^t) / (1 - alpha^t) once steps were taken (t > 0), else r
    power = lambda base: n.op("pow", n.const(base, dt), t)  # noqa: E731
    corrected = n.op("div", n.op("mul", r, n.op("sqrt", n.op("sub", 1.0, power(beta)))), n.op("sub", 1.0, power(alpha)))
    rate = n.op("where", n.op("gt", t, 0.0), corrected, r)
    xs, vs, hs = [], [], []
    for x, g, v, h in _optimizer_groups(n, 4):
        gr = _regularized(n, x, g)
        v_new = n.op("add", n.op("mul", v, alpha), n.op("mul", gr, 1 - alpha))
        h_new = n.op("add", n.op("mul", h, beta), n.op("mul", n.op("mul", gr, gr), 1 - beta))
        denom = n.op("add", n.op("sqrt", h_new), float(n.attr("epsilon", 0.0)))
        x_new = n.op("sub", x, n.op("mul", n.cast(rate, n.dtype(x)), n.op("div", v_new, denom)))
        xs.append(n.op("mul", x_new, 1.0 - float(n.attr("norm_coefficient_post", 0.0))))
        vs.append(v_new)
        hs.append(h_new)
    return xs + vs + hs


@_conv(TRAINING + "Momentum")
def _momentum(n):
    dt = n.dtype(n.x(0))
    r, t = n.x(0), n.cast(n.x(1), dt)
    alpha, beta = float(n.attr("alpha")), float(n.attr("beta"))
    nesterov = n.attr("mode") == "nesterov"
    scale = n.op("where", n.op("gt", t, 0.0), n.const(beta, dt), n.const(1.0, dt))  # beta once steps were taken
    xs, vs = [], []
    for x, g, v in _optimizer_groups(n, 3):
        gr = _regularized(n, x, g)
        v_new = n.op("add", n.op("mul", v, alpha), n.op("mul", n.cast(scale, n.dtype(x)), gr))
        direction = n.op("add", gr, n.op("mul", v_new, alpha)) if nesterov else v_new
        xs.append(n.op("sub", x, n.op("mul", n.cast(r, n.dtype(x)), direction)))
        vs.append(v_new)
    return xs + vs
