"""The drafter protocols, re-exported for drafter implementations (they live in the core:
specdecode/core/protocols.py, so that the core imports no drafter; docs/architecture.md, Invariants 5)."""

from specdecode.core.protocols import BaseDrafter, Drafter

__all__ = ["BaseDrafter", "Drafter"]
