"""``python -m ds4mlx …``: the ``ds4mlx`` command (as ``python -m ds4mlx.cli``)."""

import sys

from ds4mlx.cli import main

sys.exit(main())
