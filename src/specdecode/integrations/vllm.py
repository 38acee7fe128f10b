"""Our model-free drafters inside vLLM, as proposers for its `custom_class` speculative method.

    vllm serve MODEL --speculative-config '{"method": "custom_class",
        "model": "specdecode.integrations.vllm.SuffixProposer", "num_speculative_tokens": 4}'

vLLM imports the class named by `model`, builds it with its `VllmConfig`, calls `load_model`
once, and after every step calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`:
row i's context is `token_ids_cpu[i, :num_tokens_no_spec[i]]` (prompt and output so far, the
step's sampled tokens included), `sampled_token_ids[i]` is what the step emitted for it (empty:
the row does not decode this step, so it gets no draft), and the answer is one list of at most
`num_speculative_tokens` draft ids per row. vLLM verifies the drafts itself, so its output is
its own whatever we propose; the drafter only decides how much is accepted.

- `NgramProposer`: our prompt lookup (drafters/ngram.py), `ngram:MIN-MAX`;
- `SuffixProposer`: our suffix drafter (drafters/suffix.py) over the row's request and the pool
  of earlier outputs; vLLM verifies chains here, so the drafted chain is the tree's most-voted
  path (the nodes the drafter's vote floor keeps, at most k deep).

Options: `$SPECDECODE_VLLM_DRAFT` holds the draft spec (`ngram:2-4`, `suffix:depth=8,pool=off`),
read when vLLM builds the proposer; unset, each class uses its defaults. vLLM does not tell a
proposer which request a row holds, so each row's index is checked against the context it is
given (the same tokens before: extended; else: a new request, and the one before it, over, goes
to the pool).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from specdecode.core.batch import fork_drafter
from specdecode.core.draft_spec import VLLM_DRAFT_ENV as DRAFT_ENV
from specdecode.core.draft_spec import DraftSpec, SuffixOptions
from specdecode.drafters.ngram import lookup
from specdecode.drafters.suffix import SuffixDrafter


def _spec(kind: str) -> DraftSpec:
    """The draft spec of `$SPECDECODE_VLLM_DRAFT`, which must be of `kind`; else the default."""
    text = os.environ.get(DRAFT_ENV, "").strip()
    if not text:
        return DraftSpec.parse(kind)
    spec = DraftSpec.parse(text)
    if spec.kind != kind:
        raise ValueError(
            f"${DRAFT_ENV}={text!r} is a {spec.kind} draft; this proposer drafts {kind}"
        )
    return spec


class _Proposer:
    """What every proposer shares: vLLM's calls, per-row contexts in, chains out."""

    def __init__(self, vllm_config: Any) -> None:
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass  # no model: the text is the draft

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: Any,  # numpy [max_num_reqs] int32: each row's context length
        token_ids_cpu: Any,  # numpy [max_num_reqs, max_model_len] int32: each row's tokens
        slot_mappings: Any = None,  # vLLM's attention slots: no model here, unused
        **unused: Any,
    ) -> list[list[int]]:
        drafts: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[row])
            if not len(sampled) or n >= self.max_model_len:
                drafts.append([])
                continue
            room = min(self.k, self.max_model_len - n)
            drafts.append(self.draft(row, token_ids_cpu[row, :n].tolist(), room))
        return drafts

    def draft(self, row: int, context: list[int], k: int) -> list[int]:
        raise NotImplementedError


class NgramProposer(_Proposer):
    """Prompt lookup (drafters/ngram.py) for vLLM's `custom_class` method."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        self.min_ngram, self.max_ngram = _spec("ngram").ngram  # type: ignore[misc]

    def draft(self, row: int, context: list[int], k: int) -> list[int]:
        ids = torch.tensor(context, dtype=torch.long)  # rows change requests: no cache kept
        return lookup(ids, k, self.min_ngram, self.max_ngram).tolist()


class SuffixProposer(_Proposer):
    """Suffix drafting (drafters/suffix.py) for vLLM's `custom_class` method: one drafter per
    row, all sharing one pool, a row's chain the most-voted path of its tree."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        self.options: SuffixOptions = _spec("suffix").suffix  # type: ignore[assignment]
        self.shared = SuffixDrafter(self.options)  # its forks share its pool and calibration
        self.rows: dict[int, tuple[SuffixDrafter, list[int]]] = {}  # row -> drafter, its ids

    def _drafter(self, row: int, context: list[int]) -> SuffixDrafter:
        """Row's drafter, begun anew (the old request's output pooled) when the row's tokens are
        not an extension of what it held."""
        held = self.rows.get(row)
        if held is not None:
            drafter, ids = held
            if len(ids) <= len(context) and context[: len(ids)] == ids:
                ids.extend(context[len(ids) :])  # the drafter reads its row from this list
                return drafter
            drafter.end()  # another request took the row: the last one is over
        drafter: SuffixDrafter = fork_drafter(self.shared)  # type: ignore[assignment]
        drafter.begin(list(context), None, None, None)  # type: ignore[arg-type]
        self.rows[row] = (drafter, drafter._row)
        return drafter

    def draft(self, row: int, context: list[int], k: int) -> list[int]:
        proposal = self._drafter(row, context).suggest(context, k)
        chain: list[int] = []
        at = -1  # the root; the proposal lists the likeliest nodes first
        for node, parent in enumerate(proposal.parents):
            if parent == at:
                chain.append(proposal.tokens[node])
                at = node
        return chain[:k]
