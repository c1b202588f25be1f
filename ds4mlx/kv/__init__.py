"""ds4mlx.kv."""
