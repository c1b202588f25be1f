"""DeepSeek V4 network in MLX, checkpoint loading and the tiny checkpoint.

- ``config.ModelArgs`` — hyperparameters from transformers or DeepSeek config keys.
- ``network.Model`` — the network (``model(tokens, cache, last_only=False)``).
- ``cache.LayerCache`` — per-layer compressed KV state (``offset``, ``state``, ``nbytes``).
- ``loading.load_model`` / ``loading.LoadError`` — checkpoint directories, all layouts.
- ``fit.check_fit`` / ``errors.FitError`` — weights + KV + working memory vs the device.
- ``convert.convert`` — DeepSeek's FP8/FP4 release or any layout → ds4mlx's own layout;
  ``report.quant_report`` — agreement / KL of expert-bit choices.
- ``tiny.make_tiny`` — seeded tiny DS4-architecture checkpoint (``layers=N``: Flash layout).
- ``attention`` / ``mhc`` / ``rope`` / ``sinkhorn`` — the network's pieces, built for a small
  decode graph (docs/KERNELS.md); ``sinkhorn_src`` — the Sinkhorn kernel text (numpy only).
- ``graph.decode_step_primitives`` — primitives per decode step; ``synth.flash_model`` —
  random quantized model at Flash dimensions for benchmarks.
"""
