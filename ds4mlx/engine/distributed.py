"""``--distributed pipeline|tensor``: load one rank of either split under ``mlx.launch``
(docs/DISTRIBUTED.md). The launch, its checks and the pipeline split live in
`ds4mlx.engine.pipeline`, the tensor split in `ds4mlx.engine.tensor`."""

from __future__ import annotations

from . import pipeline, tensor


def load_distributed(path, *, mode: str = "pipeline", **kwargs):
    """`pipeline.load_distributed` for ``mode`` ``"pipeline"`` or ``"tensor"``: rank 0
    gets its ``Engine``, every other rank follows until shutdown and gets None.

    Raises:
        PipelineError: not launched with more than one rank, a bad split, or
            ``--pipeline-split`` in tensor mode.
    """
    start = tensor.start if mode == "tensor" else None
    return pipeline.load_distributed(path, mode=mode, start=start, **kwargs)
