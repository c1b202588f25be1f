"""ds4mlx.routes."""
