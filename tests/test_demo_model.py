"""The cached demo checkpoint: made once, made anew when an older ds4mlx made it."""

from __future__ import annotations

import json

from ds4mlx.model.demo import ensure_demo_model
from ds4mlx.model.tiny import tiny_config


def test_the_demo_is_made_once_and_remade_when_its_recipe_changed(tmp_path):
    path = tmp_path / "ds4mlx" / "demo"
    assert ensure_demo_model(path) == path
    weights = path / "model.safetensors"
    first = weights.stat()
    assert json.loads((path / "config.json").read_text()) == tiny_config()

    # Current: kept as it is.
    ensure_demo_model(path)
    again = weights.stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)

    # Made by a version whose tiny config differed (another Sinkhorn iteration count).
    stale = dict(tiny_config(), hc_sinkhorn_iters=7)
    (path / "config.json").write_text(json.dumps(stale))
    ensure_demo_model(path)
    assert json.loads((path / "config.json").read_text()) == tiny_config()
    assert weights.stat().st_ino != first.st_ino
    # Nothing left beside it: no temporary or moved-aside directory.
    assert sorted(p.name for p in path.parent.iterdir()) == ["demo"]
