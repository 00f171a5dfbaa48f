"""Defaults shared by the services and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO / "models"
DEFAULT_TARGET = str(MODELS_DIR / "target")
DEFAULT_DRAFT = str(MODELS_DIR / "draft")
HELDOUT_PROMPTS = MODELS_DIR / "heldout_prompts.json"  # written by models/recipe.py


def heldout_prompts_by_file() -> dict[str, str]:
    """The committed held-out prompts (first lines of held-out stdlib files), as text, by the
    stdlib file each was taken from, in the committed order."""
    return {p["file"]: p["prompt"] for p in json.loads(HELDOUT_PROMPTS.read_text())}


def heldout_prompts() -> list[str]:
    """The committed held-out prompts, as text."""
    return list(heldout_prompts_by_file().values())

DRAFT_ADDRESS = "unix:///tmp/specdec/draft.sock"
VERIFY_ADDRESS = "127.0.0.1:50052"
GATEWAY_ADDRESS = "127.0.0.1:50051"

NUM_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 16

RECENT_CAPACITY = 10_000  # finished requests the verify service remembers for RecentRequests
