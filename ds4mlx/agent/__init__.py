"""ds4mlx.agent."""
