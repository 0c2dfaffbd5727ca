"""What other services know about the embedded engine (``services/engine``) without
importing it: the proxy loads the default model's tokenizer for token mode from here."""

from __future__ import annotations

from pathlib import Path

# The tiny model the embedded engine creates on first start when given no model dir.
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "polar" / "models" / "tiny"
