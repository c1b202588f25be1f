"""ds4mlx.model."""
