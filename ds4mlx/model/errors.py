"""Errors of the model room (importable without MLX)."""

from __future__ import annotations


class LoadError(Exception):
    """The directory is not a loadable DeepSeek V4 checkpoint (message says why)."""


class FitError(LoadError):
    """The checkpoint plus its KV cache and working memory would not fit the device.

    Attributes:
        report: the ``fit.FitReport`` with the numbers.
    """

    def __init__(self, message: str, report):
        super().__init__(message)
        self.report = report
