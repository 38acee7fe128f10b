"""How many tokens to draft next: fixed, heuristic (Hugging Face's schedule) or a cost model.

A `KPolicy` is asked for the look-ahead `k` before every step and told what happened after it.
Choosing k only from past steps keeps decoding lossless: k never depends on the target's
randomness in the step it is used for. (Stopping a draft early when the drafter is unsure is the
drafter's job: `ModelDrafter(confidence=...)`, combinable with any policy.)

Costs (docs/architecture.md, Vocabulary; metrics.py): the cost ratio c = draft forward time /
target single-token forward time, the verify cost v(k) = target forward time over k+1 tokens /
over 1.
`CostK` maximises expected emitted tokens per unit of time,

    E[emitted](k) / (k·c + v(k)),   E[emitted](k) = 1 + sum_{i=1..k} prod_{j<=i} a_j,

where a_j is the probability that draft position j is accepted given positions 1..j-1 were.
With i.i.d. acceptance α this is `metrics.ideal_speedup(α, k, c, v(k))`.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from specdecode.core.types import ForwardMeter

K_POLICIES = ("fixed", "heuristic", "cost")
# forward times a size needs before the cost policy trusts them to rule out exploring it: one
# slow forward (a VM's hiccup, a first call's warm-up) must not keep a k from ever being tried
TRUSTED_SAMPLES = 3
# steps after which a size's forward times are old: they no longer rule a k out, and the next
# time measured there replaces them. Costs measured once (a warm-up's slow draft forwards) must
# not keep a policy at k = 0 for good: a k it never tries is never measured again
STALE_STEPS = 256
# recent forwards whose time against their size's own estimate gives the machine's speed: a
# shared VM's speed drifts, and every size's time moves with it (`CostK`, speed)
SPEED_WINDOW = 3
# the largest target forward (rows) whose time the cost policy keeps: a chain's k_max + 1 per
# row, or a token tree's nodes + 1 (drafters size their trees from these times: `verify_cost`)
MAX_TIMED_ROWS = 64
PRIOR_VERIFY_SLOPE = 0.05  # v(n) = 1 + slope (n - 1) before anything is measured


@runtime_checkable
class KPolicy(Protocol):
    name: str  # "fixed", "heuristic", "cost" (reported in Stats.k_policy)
    k_max: int  # the largest k it ever asks for

    def begin(self) -> None:
        """Start a new sequence."""

    def next_k(self, max_k_allowed: int) -> int:
        """The look-ahead for the next step, in 0..min(k_max, max_k_allowed) (0 = plain AR step)."""

    def observe(
        self, drafted: int, accepted: int, draft_s: float | None, target_s: float | None
    ) -> None:
        """Learn from the step just done: tokens drafted (may be fewer than asked) and accepted,
        seconds spent in draft and target forwards (None when forwards are not timed)."""

    def next_batch_k(self, max_k_allowed: int, rows: int) -> int | None:
        """The look-ahead for a step of `rows` rows (a batch; `Batch` asks when rows > 1);
        None: `next_k`'s, as for one sequence (the default: a policy that knows one only)."""
        return None

    def begins_drafts(self) -> bool:
        """Whether the step just chosen may begin drafts not begun yet (a model draft's
        prefill); False: only rows already drafting draft (`Batch.step`). Default: True."""
        return True

    def pays_to_begin(
        self, k: int | None, rows: int, remaining: int, prefill_s: float | None
    ) -> bool:
        """Whether a row that may still emit `remaining` tokens should begin its draft (a
        prefill of `prefill_s` seconds, None where not measured) to draft k (None: the best k
        for) a batch of `rows`. Default: True."""
        return True

    def observe_step(
        self,
        steps: list[tuple[int, int]],
        draft_s: float | None,
        target_s: float | None,
        verified: int,
    ) -> None:
        """Learn from a step of `len(steps)` rows: (drafted, accepted) per row, the step's
        seconds in draft and target forwards, the tokens it verified. Default: each row's
        `observe`, timed only when it ran alone (its times are not one row's when rows share)."""
        timed = len(steps) == 1
        for drafted, accepted in steps:
            times = (draft_s, target_s) if timed else (None, None)
            self.observe(drafted, accepted, *times)


class FixedK(KPolicy):
    """The same k every step."""

    name = "fixed"

    def __init__(self, k: int) -> None:
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an integer >= 0 (got {k!r})")
        self.k = self.k_max = k

    def begin(self) -> None:
        pass

    def next_k(self, max_k_allowed: int) -> int:
        return max(0, min(self.k, max_k_allowed))

    def observe(
        self, drafted: int, accepted: int, draft_s: float | None, target_s: float | None
    ) -> None:
        pass


class HeuristicK(KPolicy):
    """Hugging Face's "heuristic" schedule: k += 2 after a step whose drafts were all accepted,
    k -= 1 otherwise (never below 1), here also capped at `k_max`. k restarts at `k0` for each
    sequence (HF's "heuristic_transient"; plain "heuristic" carries k over between calls)."""

    name = "heuristic"

    def __init__(self, k0: int, k_max: int) -> None:
        if not (isinstance(k0, int) and isinstance(k_max, int) and 1 <= k0 <= k_max):
            raise ValueError(f"heuristic k needs integers 1 <= k0 <= k_max (got {k0}, {k_max})")
        self.k0, self.k_max = k0, k_max
        self.k = k0

    def begin(self) -> None:
        self.k = self.k0

    def next_k(self, max_k_allowed: int) -> int:
        return max(0, min(self.k, max_k_allowed))

    def observe(
        self, drafted: int, accepted: int, draft_s: float | None, target_s: float | None
    ) -> None:
        if drafted == 0:  # nothing drafted (no n-gram match, or the last token): no evidence
            return
        self.k = min(self.k + 2, self.k_max) if accepted == drafted else max(1, self.k - 1)


class _Mean:
    """A running mean that turns into an exponential moving average after `memory` samples,
    so old evidence fades (the text's difficulty and the machine's load drift)."""

    def __init__(self, memory: int) -> None:
        self.memory = memory
        self.n = 0  # effective sample count, capped at memory
        self.mean = 0.0

    def add(self, x: float) -> None:
        self.n = min(self.n + 1, self.memory)
        self.mean += (x - self.mean) / self.n


class _Median:
    """The median of the last `memory` samples: a forward time that one slow forward cannot
    move far (a mean would carry it for dozens of steps), and that forgets old samples as the
    machine's load drifts."""

    def __init__(self, memory: int) -> None:
        self.samples: deque[float] = deque(maxlen=memory)
        self.value = 0.0  # the median, kept on `add`: every step reads it for every size seen
        self.last = 0  # the step (`CostK`'s clock) of the newest sample

    @property
    def n(self) -> int:
        return len(self.samples)

    def add(self, x: float, step: int = 0) -> None:
        """`x` measured at `step`; samples older than `STALE_STEPS` steps go first."""
        if step - self.last > STALE_STEPS:
            self.samples.clear()
        self.samples.append(x)
        self.value = statistics.median(self.samples)
        self.last = step

    def fresh(self, step: int) -> bool:
        """Whether its samples are trusted at `step`: enough of them, the newest not old."""
        return self.n >= TRUSTED_SAMPLES and step - self.last <= STALE_STEPS


class CostK(KPolicy):
    """Picks the k in 0..k_max that maximises expected emitted tokens per unit of time, for one
    sequence or for a batch of them (`next_batch_k`).

    Estimates, all online:
    - acceptance a_j per draft position j: the mean of "accepted" over the steps where position j
      was drafted and positions 1..j-1 were accepted, shrunk towards a prior of weight
      `prior_weight`: a_1's prior is `prior_acceptance`, a_j's is the estimate of a_{j-1}
      (untried deep positions inherit the last tried one). Reset at `begin()`: acceptance
      depends on the prompt. A batch's rows share one estimate.
    - target forward time T(n) over n rows (a step of B sequences drafting k verifies B(k+1)),
      the median of the last `memory` per n; an n not seen yet is interpolated linearly
      between the nearest seen n, or extrapolated from the nearest with the slope fitted to the
      seen ones. v(k) = T(B(k+1)) / T(1): at B = 1 the verify cost of the glossary.
    - draft time per depth D(B) (one forward of the draft model over the batch's B rows); c =
      D(B) / T(1). A step whose draft also caught up on the tokens of steps at k = 0 before it
      is not timed for it (`Batch._observe`).
    - the machine's speed: the median, over the last `SPEED_WINDOW` timed steps of a size
      measured `TRUSTED_SAMPLES` times before, of the forward's time over that size's
      estimate. Times are stored divided by it, so that a size measured while the machine ran
      fast (a shared VM's load moves every forward's time together) is not judged cheaper than
      one measured since: a server's policy learns one batch size for minutes, then another.
      Rates, ratios of times, do not depend on it.
    Costs are properties of the models and the machine, so they carry over between sequences.
    Without a clock (untimed forwards) the priors stand in: T(n) / T(1) = 1 + `verify_slope`·(n -
    1) and c = `cost_ratio` (the engine passes the draft/target parameter ratio), times the same
    slope's growth for B rows; choices are then deterministic for a given sequence of
    acceptances.

    A batch's rate at k is B x expected emitted per row / (k·c + v(k)): where v grows with the
    rows (arithmetic-bound forwards), large batches pick small k, down to 0.

    Every `explore_every`-th step drafts a neighbour of the best k instead (alternately one
    more and one fewer) so the estimates of other ks do not go stale; when the best k is 0
    it explores k = 1, because a k = 0 step teaches nothing about acceptance. A neighbour whose
    costs at this batch size are measured (`TRUSTED_SAMPLES` forwards each, or interpolated
    between sizes that are) and which would not beat the best k even with every drafted token
    accepted is not explored (its step could only lose time), until those costs are
    `STALE_STEPS` steps old: then it is tried again and measured afresh, so that costs measured
    while the machine or the draft was slow do not rule it out for good. 0 disables it. Once
    any drafted token has been judged (`knows_acceptance`), an exploration (`exploring`) drafts
    only on the rows whose drafts have begun (`begins_drafts`): a row's draft prefill, paid for
    one step that only refreshes an estimate, costs more than the step teaches.
    """

    name = "cost"

    def __init__(
        self,
        k_max: int,
        *,
        cost_ratio: float = 0.25,
        verify_slope: float = PRIOR_VERIFY_SLOPE,
        prior_acceptance: float = 0.6,
        prior_weight: float = 2.0,
        memory: int = 32,
        explore_every: int = 8,
    ) -> None:
        if not isinstance(k_max, int) or k_max < 1:
            raise ValueError(f"k_max must be an integer >= 1 (got {k_max!r})")
        if cost_ratio < 0 or verify_slope < 0 or not 0 <= prior_acceptance <= 1:
            raise ValueError("cost_ratio, verify_slope >= 0 and prior_acceptance in [0, 1]")
        if prior_weight <= 0 or memory < 1 or explore_every < 0:
            raise ValueError("prior_weight > 0, memory >= 1 and explore_every >= 0 needed")
        self.k_max = k_max
        self.cost_ratio, self.verify_slope = cost_ratio, verify_slope
        self.prior_acceptance, self.prior_weight = prior_acceptance, prior_weight
        self.memory, self.explore_every = memory, explore_every
        self._target: dict[int, _Median] = {}  # rows verified -> seconds of the forward
        self._draft: dict[int, _Median] = {}  # batch rows -> seconds per drafted depth
        # times above are stored divided by the speed at the time: the machine's speed now
        self._speed_ratios: deque[float] = deque(maxlen=SPEED_WINDOW)
        self._speed = 1.0
        self._clock = 0  # steps observed, over every sequence: the age of a time measured
        # the target's times as of the last step observed (a batch sizing its trees reads
        # T(rows) dozens of times a step)
        self._curve = _Curve({}, verify_slope)
        self._curve_at = -1
        self.begin()

    def begin(self) -> None:
        self._accept = [_Mean(self.memory) for _ in range(self.k_max)]  # position j = index + 1
        self._steps = 0
        self._last = 0
        self.exploring = False  # the last choice is a neighbour tried, not the best k

    # -- estimates --------------------------------------------------------------------------

    def acceptance(self) -> list[float]:
        """[k_max] estimated a_j: P(position j accepted | positions 1..j-1 accepted)."""
        out, prior = [], self.prior_acceptance
        for m in self._accept:
            prior = (m.n * m.mean + self.prior_weight * prior) / (m.n + self.prior_weight)
            out.append(prior)
        return out

    def _target_time(self, rows: int) -> float | None:
        """T(rows): seconds of a target forward over that many rows (None before any timed
        step)."""
        if self._curve_at != self._clock:  # a step observed since: the times moved
            self._curve = _Curve(self._target, self.verify_slope)
            self._curve_at = self._clock
        return self._curve.at(rows)

    def verify_cost(self, rows: int) -> float:
        """T(rows) / T(1): a target forward over `rows` rows (a token tree's nodes + 1) next to
        one over a single row, measured where anything is, else the prior slope; >= 1."""
        t1 = self._target_time(1)
        if t1 is None:
            return 1 + self.verify_slope * (rows - 1)
        return max(1.0, (self._target_time(rows) or t1) / t1)

    def draft_cost(self, seconds_per_depth: float | None) -> float:
        """c for a draft whose forward takes `seconds_per_depth` (a drafter that times its own
        forwards: drafters/hybrid.py) next to the target's single-row forward; the prior
        `cost_ratio` when either is not measured yet."""
        t1 = self._target_time(1)
        if seconds_per_depth is None or t1 is None:
            return self.cost_ratio
        return seconds_per_depth / self._speed / t1

    def costs(self, rows: int = 1) -> tuple[float, list[float]]:
        """(c, [v(0) .. v(k_max)]) for a batch of `rows` sequences, from measurements where
        there are any, else the priors; v(k) = T(rows (k + 1)) / T(1)."""
        growth = 1 + self.verify_slope * (rows - 1)  # the prior's cost of B rows over one
        t1 = self._target_time(1)
        if t1 is None:
            v = [1 + self.verify_slope * (rows * (k + 1) - 1) for k in range(self.k_max + 1)]
            return self.cost_ratio * growth, v
        times = [self._target_time(rows * (k + 1)) or t1 for k in range(self.k_max + 1)]
        # clamp: noise must not make more rows cheaper than the step's own k = 0
        v = [max(t, times[0]) / t1 for t in times]
        v = [max(1.0, x) for x in v] if rows == 1 else v
        draft = _Curve(self._draft, self.verify_slope).at(rows)
        c = draft / t1 if draft is not None else self.cost_ratio * growth
        return c, v

    def rates(self, k_limit: int | None = None, rows: int = 1) -> list[float]:
        """Expected emitted tokens per target-single-token time, for k = 0..k_limit, for a
        batch of `rows` sequences."""
        k_limit = self.k_max if k_limit is None else min(k_limit, self.k_max)
        c, v = self.costs(rows)
        a = self.acceptance()
        rates, emitted, reach = [], 1.0, 1.0
        for k in range(k_limit + 1):
            if k:
                reach *= a[k - 1]  # P(positions 1..k all accepted)
                emitted += reach
            rates.append(rows * emitted / (k * c + v[k]))
        return rates

    # -- the policy -------------------------------------------------------------------------

    def next_k(self, max_k_allowed: int) -> int:
        return self.next_batch_k(max_k_allowed, 1)

    def next_batch_k(self, max_k_allowed: int, rows: int) -> int:
        """The k every row of a batch of `rows` sequences drafts this step."""
        limit = min(self.k_max, max_k_allowed)
        if limit <= 0:
            return 0
        rates = self.rates(limit, rows)
        best = max(range(limit + 1), key=rates.__getitem__)  # ties: the smaller k
        self._steps += 1
        if self.explore_every and self._steps % self.explore_every == 0:
            up = (self._steps // self.explore_every) % 2 == 1
            options = [n for n in (best + 1, best - 1) if 0 <= n <= limit]
            if best == 0:
                options = [1]
            elif not up and len(options) == 2:
                options.reverse()
            options = [n for n in options if self._worth_trying(n, rows, best, rates[best])]
            self.exploring = bool(options)
            best = options[0] if options else best
        else:
            self.exploring = False
        self._last = best
        return best

    @property
    def knows_acceptance(self) -> bool:
        """Whether any drafted token was judged since `begin`."""
        return self._accept[0].n > 0

    def begins_drafts(self) -> bool:
        """Not for an exploration once acceptance is known: the step only refreshes an
        estimate, which is not worth a draft's prefill."""
        return not (self.exploring and self.knows_acceptance)

    def pays_to_begin(
        self, k: int | None, rows: int, remaining: int, prefill_s: float | None
    ) -> bool:
        """Whether the time drafting k (None: the best k at this batch size, as `next_batch_k`
        would choose it, unexplored) saves over a row's `remaining` tokens at this batch
        size covers its draft's prefill. Each token costs the row's share of a step, T(1) /
        rate(k) (`rates`: a batch's tokens per T(1)), so drafting saves remaining x T(1) x
        (1 / rate(0) - 1 / rate(k)). Short answers behind long prompts, and batches where k
        barely beats 0, do not pay for it: those rows decode without drafting (a batch job of
        short answers otherwise prefills drafts for a few k = 1 steps: docs/results.md, "Batch
        jobs"). True until acceptance, T(1) and a prefill's time are measured: a first
        estimate must be learnt somewhere."""
        t1 = self._target_time(1)
        if prefill_s is None or t1 is None or not self.knows_acceptance or k == 0:
            return True
        rates = self.rates(k, rows)
        best = max(rates) if k is None else rates[-1]
        saved = remaining * t1 * self._speed * (1 / rates[0] - 1 / best)
        return saved > prefill_s

    def _worth_trying(self, k: int, rows: int, best: int, best_rate: float) -> bool:
        """Whether a step at k can teach something that changes a choice: the times that
        compare it with the best k at this batch size are not trusted yet (`_trusted`), or it
        would beat the best rate even if every drafted token were accepted. A neighbour that
        cannot pay at full acceptance (a large batch on arithmetic-bound forwards) is not
        explored: the step would only cost. (The one-row time T(1) that rates are measured in
        cancels out of the comparison: a batch that never runs one row must not wait for it.)"""
        compared = (rows * (k + 1), rows * (best + 1))
        if not all(_trusted(self._target, n, self._clock) for n in compared):
            return True
        if (k or best) and not _trusted(self._draft, rows, self._clock):
            return True
        c, v = self.costs(rows)
        return rows * (k + 1) / (k * c + v[k]) > best_rate

    def observe(
        self, drafted: int, accepted: int, draft_s: float | None, target_s: float | None
    ) -> None:
        self.observe_step([(drafted, accepted)], draft_s, target_s, drafted + 1)

    def observe_step(
        self,
        rows: list[tuple[int, int]],
        draft_s: float | None,
        target_s: float | None,
        verified: int,
    ) -> None:
        """Learn one step of a batch: (drafted, accepted) per row, the seconds of its draft and
        target forwards, and the rows the target forward verified."""
        self._clock += 1
        for drafted, accepted in rows:
            # positions 1..accepted were accepted; position accepted+1 (if drafted) was
            # rejected; later positions were never judged
            for j in range(min(accepted + 1, drafted, self.k_max)):
                self._accept[j].add(1.0 if j < accepted else 0.0)
        depth = max(drafted for drafted, _ in rows)
        if target_s is not None and verified <= max(len(rows) * (self.k_max + 1), MAX_TIMED_ROWS):
            seen = self._target.get(verified)
            if seen is not None and seen.n >= TRUSTED_SAMPLES and seen.value > 0:
                self._speed_ratios.append(target_s / seen.value)
                self._speed = statistics.median(self._speed_ratios)
            times = self._target.setdefault(verified, _Median(self.memory))
            times.add(target_s / self._speed, self._clock)
        # per drafted depth: with confidence stops the one unused forward is charged to them
        # (a step with no draft forward, a suffix or n-gram draft's, says nothing of its cost)
        if draft_s and depth:
            per_depth = draft_s / depth / self._speed
            drafting = sum(1 for drafted, _ in rows if drafted)  # the draft forward's rows
            self._draft.setdefault(drafting, _Median(self.memory)).add(per_depth, self._clock)


def _trusted(seen: dict[int, _Median], n: int, step: int) -> bool:
    """Whether the time `_Curve.at` gives at n rests on trusted measurements at `step`: n's own
    (`_Median.fresh`), or, for an n never measured, both neighbours it is interpolated
    between. (A batch's size moves as rows come and go: with a size's own samples required,
    every new size was explored before its neighbours could rule it out, each exploration
    paying the drafts' prefills and catch-up.)"""
    if n in seen:
        return seen[n].fresh(step)
    below = [i for i in seen if i < n]
    above = [i for i in seen if i > n]
    if not below or not above:  # extrapolated: one side only
        return False
    return seen[max(below)].fresh(step) and seen[min(above)].fresh(step)


class _Curve:
    """Times measured at some n, read at any n: linear between the nearest seen n on either
    side, else extrapolated from the nearest with the least-squares slope of all seen (one
    point: the prior's relative slope), never sloping down and never below a tenth of the
    cheapest seen. Built once for many readings (a batch sizing its trees reads dozens)."""

    def __init__(self, seen_times: dict[int, _Median], prior_slope: float) -> None:
        seen = sorted((i, m.value) for i, m in seen_times.items() if m.n)
        self.n = [i for i, _ in seen]
        self.t = [t for _, t in seen]
        self.floor = 0.1 * min(self.t) if seen else 0.0
        if len(seen) >= 2:
            xm = sum(self.n) / len(seen)
            ym = sum(self.t) / len(seen)
            var = sum((i - xm) ** 2 for i in self.n)
            self.slope: float | None = max(0.0, sum((i - xm) * (t - ym) for i, t in seen) / var)
        else:
            self.slope = None  # from the prior, relative to the one point
        self.prior_slope = prior_slope

    def at(self, n: int) -> float | None:
        """The time at n; None when nothing was measured."""
        if not self.n:
            return None
        j = bisect.bisect_left(self.n, n)  # self.n[j - 1] < n <= self.n[j]
        if j < len(self.n) and self.n[j] == n:
            return self.t[j]
        if 0 < j < len(self.n):
            i0, t0, i1, t1 = self.n[j - 1], self.t[j - 1], self.n[j], self.t[j]
            return t0 + (t1 - t0) * (n - i0) / (i1 - i0)
        i0, t0 = (self.n[-1], self.t[-1]) if j else (self.n[0], self.t[0])
        slope = self.slope
        if slope is None:
            slope = t0 * self.prior_slope / (1 + self.prior_slope * (i0 - 1))
        return max(t0 + slope * (n - i0), self.floor)


def verify_cost(policy: object, rows: int) -> float:
    """v(rows), a target forward over `rows` rows next to one over a single row: the batch's
    cost policy's measurement (`CostK.verify_cost`), else the prior slope (any other policy,
    or none)."""
    if isinstance(policy, CostK):
        return policy.verify_cost(rows)
    return 1 + PRIOR_VERIFY_SLOPE * (rows - 1)


def batch_rate(
    policy: object, rows: int, emitted: float, verified: int, draft: float = 0.0
) -> float:
    """Expected tokens per single-row target time of a step in which each of `rows` rows emits
    `emitted` tokens (expected), puts `verified` rows into the target's forward and spends
    `draft` single-row target forwards on its share of the draft's (k·c): the rate of a batch
    whose rows all do alike (v: `verify_cost`), which at rows = 1 is one row's,
    emitted / (draft + v(verified)). A row of a batch that prices its draft by this rate weighs
    its extra verified rows against the batch's larger forward, as the cost policy prices a
    batch's k (`CostK.rates`)."""
    return rows * emitted / (rows * draft + verify_cost(policy, rows * verified))


def size_trees(
    gains: Sequence[Sequence[float]], rows: int, tokens: float, policy: object
) -> tuple[list[int], float]:
    """(counts, rate): how many candidate nodes of each tree to verify in one forward, and the
    expected tokens per verification time that gives. The likeliest nodes of any tree come
    first (each tree's gains are non-increasing, so each keeps a prefix: a tree), as many as
    make tokens / v(rows + nodes) the highest (v: the policy's measured costs, `verify_cost`);
    `rows` and `tokens`: what the forward verifies and emits without them (a batch's rows and
    their chains' tokens; one token a row). One tree alone on one row (rows = tokens = 1) is
    sized as a sequence alone is; in a batch a node pays only where it adds more than its share
    of the larger forward."""
    order = sorted(
        ((gain, tree) for tree, row in enumerate(gains) for gain in row),
        key=lambda item: -item[0],  # stable: a tree's equal gains keep their order
    )
    best, best_rate, total = 0, tokens / verify_cost(policy, rows), tokens
    for n, (gain, _) in enumerate(order, start=1):
        total += gain
        rate = total / verify_cost(policy, rows + n)
        if rate > best_rate:
            best, best_rate = n, rate
    counts = [0] * len(gains)
    for _, tree in order[:best]:
        counts[tree] += 1
    return counts, best_rate


def make_k_policy(name: str, k: int, *, cost_ratio: float | None = None) -> KPolicy:
    """`fixed` (k every step), `heuristic` (starts at k, grows up to 2k) or `cost` (k_max = k;
    `cost_ratio` is its prior for c when forwards are untimed)."""
    if name == "fixed":
        return FixedK(k)
    if name == "heuristic":
        return HeuristicK(k, 2 * k)
    if name == "cost":
        return CostK(k) if cost_ratio is None else CostK(k, cost_ratio=cost_ratio)
    raise ValueError(f"unknown k policy {name!r}; choose one of {', '.join(K_POLICIES)}")


# -- helpers for the core and the engine -----------------------------------------------------


def forward_seconds(meter: ForwardMeter) -> tuple[float, float] | None:
    """Seconds spent so far in (draft, target) forwards, or None when forwards are untimed."""
    if meter.clock is None:
        return None
    return meter.seconds.get("draft", 0.0), meter.seconds.get("target", 0.0)


def seconds_since(
    meter: ForwardMeter, before: tuple[float, float] | None
) -> tuple[float | None, float | None]:
    """(draft_s, target_s) spent since `before = forward_seconds(meter)`; Nones if untimed."""
    after = forward_seconds(meter)
    if before is None or after is None:
        return None, None
    return after[0] - before[0], after[1] - before[1]


def compute_params(model: Any) -> int:
    """Parameters a forward multiplies by: all but the input embedding (a lookup), unless the
    embedding is tied to the output head."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    if getattr(model.get_output_embeddings(), "weight", None) is not embed:
        total -= embed.numel()
    return total


def prior_cost_ratio(target: Any, drafter: Any) -> float | None:
    """A clock-free guess at c: draft / target parameter count (forwards at batch 1 are
    memory-bound, so time tracks bytes read). A drafter that knows its c says so in a
    `cost_ratio` attribute (n-gram: 0, no model); None when it cannot tell."""
    known = drafter.cost_ratio
    if known is not None:
        return float(known)
    model = getattr(drafter, "model", None)
    if model is None:
        return None
    try:
        return compute_params(model) / max(1, compute_params(target))
    except (AttributeError, TypeError):
        return None
