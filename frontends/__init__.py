"""Frontends: PyTorch (torch.export) and ONNX onto the tg dialect, through ir.builder."""

from tilegraph.ir.errors import TilegraphError


class FrontendError(TilegraphError):
    """A model the frontend cannot import; the message lists every problem found."""
