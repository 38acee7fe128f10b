"""Drafters: whatever proposes tokens (a second model, the target's first layers, prompt
lookup, suffix trees over the request and earlier outputs, a model and suffix trees in turns,
an EAGLE-style head, or a model growing a token tree), and the one factory that
builds them (factory.py)."""

from specdecode.core.draft_spec import DraftSpec
from specdecode.core.protocols import BaseDrafter, Drafter
from specdecode.drafters.early_exit import EarlyExitDrafter
from specdecode.drafters.factory import hybrid_drafter, make_drafter, resolve_draft
from specdecode.drafters.hybrid import HybridDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import SuffixDrafter, SuffixPool

__all__ = [
    "BaseDrafter",
    "DraftSpec",
    "Drafter",
    "EarlyExitDrafter",
    "HybridDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "SuffixDrafter",
    "SuffixPool",
    "hybrid_drafter",
    "make_drafter",
    "resolve_draft",
]
