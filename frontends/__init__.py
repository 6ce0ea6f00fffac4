"""Frontends: PyTorch (torch.export) and ONNX onto the tg dialect, through ir.builder."""

from tilegraph.ir.errors import TilegraphError


class FrontendError(TilegraphError):
    """A model the frontend cannot import; the message lists every problem found."""


# The seed of every dropout of a model a frontend imports in training mode: a weight (0 when
# imported), which a training step turns into an input it feeds a new value each step.
DROPOUT_SEED = "dropout.seed"
