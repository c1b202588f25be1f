"""ds4mlx.dsml."""
