"""Converters: DFT and STFT, as matmuls."""

from __future__ import annotations

import numpy as np

from tilegraph.frontends import FrontendError
from tilegraph.frontends.onnx.node import _axis, _conv


# --- DFT and STFT, as matmuls ---


def _dft_matrix(length_in: int, complex_in: bool, length: int, inverse: bool, onesided: bool) -> np.ndarray:
    """The real matrix of ONNX's DFT along one axis: (length_in * c_in, K * c_out), where a row
    is an input (real[, imag]) pair and a column an output one. The transform is linear, so it is
    np.fft itself applied to the basis vectors (padding or truncating to `length` as ONNX does)."""
    c_in = 2 if complex_in else 1
    basis = np.eye(length_in * c_in).reshape(-1, length_in, c_in)
    z = basis[..., 0] + 1j * basis[..., 1] if complex_in else basis[..., 0]
    if inverse and onesided:
        out = np.fft.irfft(z, n=length, axis=1)[..., None]
    else:
        f = np.fft.ifft(z, n=length, axis=1) if inverse else np.fft.fft(z, n=length, axis=1)
        if onesided:
            f = f[:, :length // 2 + 1]
        out = np.stack([f.real, f.imag], axis=-1)
    return out.reshape(length_in * c_in, -1)


def _along_last_two(n, x, axis: int, matrix: np.ndarray, c_out: int):
    """Apply `matrix` to the (axis, last) dims of x, the result keeping x's dim order."""
    r = n.rank(x)
    perm = [d for d in range(r - 1) if d != axis] + [axis, r - 1]
    moved = n.transpose(x, perm)
    lead = n.shape(moved)[:-2]
    flat = n.reshape(moved, (*lead, matrix.shape[0]))
    y = n.op("matmul", flat, n.const(matrix, n.dtype(x)))
    y = n.reshape(y, (*lead, matrix.shape[1] // c_out, c_out))
    return n.transpose(y, [perm.index(d) for d in range(r)])


@_conv("DFT")
def _dft(n):
    x = n.x(0)
    r = n.rank(x)
    if n.opset >= 20:
        axis = n.static_ints(2)[0] if n.opt(2) is not None else -2
    else:
        axis = n.attr("axis", 1)
    axis = _axis(int(axis), r)
    if axis == r - 1:
        raise FrontendError("the DFT axis cannot be the last (real, imaginary) dim")
    inverse, onesided = bool(n.attr("inverse", 0)), bool(n.attr("onesided", 0))
    size, c_in = n.shape(x)[axis], n.shape(x)[-1]
    if not isinstance(size, int) or c_in not in (1, 2):
        raise FrontendError(f"the signal length must be static and the last dim 1 or 2, got {n.info(x)}")
    length = n.static_ints(1)[0] if n.opt(1) is not None else (2 * (size - 1) if inverse and onesided else size)
    matrix = _dft_matrix(size, c_in == 2, int(length), inverse, onesided)
    return _along_last_two(n, x, axis, matrix, 1 if inverse and onesided else 2)


@_conv("STFT")
def _stft(n):
    """Frames gathered by a constant index, weighted by the window, then one DFT matmul."""
    x, window = n.x(0), n.opt(2)
    step = int(n.static_ints(1)[0])
    batch, size, c_in = n.shape(x)
    if n.opt(3) is not None:
        frame = int(n.static_ints(3)[0])
    elif window is not None:
        frame = n.shape(window)[0]
    else:
        frame = size
    if not all(isinstance(d, int) for d in (size, frame)) or step <= 0 or not 0 < frame <= size:
        raise FrontendError(f"frame_step {step} and frame length {frame} must be static and fit {n.info(x)}")
    frames = 1 + (size - frame) // step
    index = np.arange(frames)[:, None] * step + np.arange(frame)[None, :]
    framed = n.op("gather", x, n.const(index, "i64"), axis=1)  # (batch, frames, frame, c_in)
    if window is not None:
        framed = n.op("mul", framed, n.reshape(n.cast(window, n.dtype(x)), (1, 1, frame, 1)))
    matrix = _dft_matrix(frame, c_in == 2, frame, False, bool(n.attr("onesided", 1)))
    return _along_last_two(n, framed, 2, matrix, 2)
