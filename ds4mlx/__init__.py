"""ds4mlx: DeepSeek V4 Flash inference server and coding agent on MLX."""

__version__ = "0.1.0"
