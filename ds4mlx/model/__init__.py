"""DeepSeek V4 network in MLX, checkpoint loading and the tiny checkpoint.

- ``config.ModelArgs`` — hyperparameters from transformers or DeepSeek config keys.
- ``network.Model`` — the network (``model(tokens, cache, last_only=False)``).
- ``cache.LayerCache`` — per-layer compressed KV state (``offset``, ``state``, ``nbytes``).
- ``loading.load_model`` / ``loading.LoadError`` — checkpoint directories, all layouts.
- ``tiny.make_tiny`` — seeded tiny DS4-architecture checkpoint.
"""
