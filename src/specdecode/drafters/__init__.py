"""Drafters: whatever proposes tokens (a second model, the target's first layers, prompt
lookup, an EAGLE-style head, or any of these growing a token tree), and the one factory that
builds them (factory.py)."""

from specdecode.core.draft_spec import DraftSpec
from specdecode.core.protocols import BaseDrafter, Drafter
from specdecode.drafters.early_exit import EarlyExitDrafter
from specdecode.drafters.factory import make_drafter, resolve_draft
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.ngram import NgramDrafter

__all__ = [
    "BaseDrafter",
    "DraftSpec",
    "Drafter",
    "EarlyExitDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "make_drafter",
    "resolve_draft",
]
