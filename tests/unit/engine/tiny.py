"""One tiny model directory per test process (building it trains a tokenizer: ~3 s)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path


@cache
def tiny_model_dir() -> Path:
    from services.engine.modelinit import init_model_dir

    root = Path(tempfile.mkdtemp(prefix="polar-tiny-"))
    atexit.register(shutil.rmtree, root, True)
    return init_model_dir(root / "tiny", seed=0)


@cache
def second_checkpoint() -> Path:
    """The same model with differently seeded weights: a 'trained' checkpoint."""
    from services.engine.modelinit import reseed_weights

    return reseed_weights(tiny_model_dir(), tiny_model_dir().parent / "tiny-v2", seed=1)


@cache
def vision_model_dir() -> Path:
    """The tiny model with an image encoder (``polar model init --vision``)."""
    from services.engine.modelinit import init_model_dir

    root = Path(tempfile.mkdtemp(prefix="polar-tiny-vision-"))
    atexit.register(shutil.rmtree, root, True)
    return init_model_dir(root / "tiny-vision", seed=0, vision=True)
