"""Training the draft on the target's answers: LoRA adapters (peft) on every linear layer of the
draft but its output layer, float32 master weights, bfloat16 autocast where the draft serves in
bfloat16 and it is faster (a GPU that has it; a CPU where a measured linear layer's forward and
backward say so: on AVX2 CPUs PyTorch's bfloat16 matrix products are many times slower than
float32 ones, docs/results.md), AdamW. The output layer and the loss run at
the answer positions only, a few at a time (`answer_logits`), and on Linux glibc's malloc keeps
the memory a step frees for the next (`keep_freed_memory`).

One step = `batch_size` answers in one forward (`batch_loss`: right-padded, which a causal
model's real positions never see), the loss (loss.py) averaged over their tokens, gradients
clipped to norm 1, a learning rate warmed up over the first `WARMUP_STEPS` steps. The answers
are visited in a seeded order, reshuffled per pass: step s always trains on the same answers,
so a resumed run is the run that was interrupted.

A budget (settings.Budget) bounds it: trained tokens (a step that would pass it is not run), or
seconds of training summed over resumed runs (no step starts that the mean step time says would
pass it). A token budget below the first step's tokens, or a time budget shorter than the first
step took, is a ValueError: nothing would be learnt. Checkpoints (DIR/checkpoints/step-N.pt: the
adapter's weights, the optimizer's state, the step, tokens, seconds and the loss curve) every
`checkpoint_every` steps, at the end and on an interrupt; the two newest are kept.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdecode.distill.data import Answer
from specdecode.distill.loss import distill_loss
from specdecode.distill.settings import Budget, DistillSettings
from specdecode.models.adapters import peft_modules, quiet_peft
from specdecode.models.files import load_tensors, save_tensors

WARMUP_STEPS = 10
KEEP_CHECKPOINTS = 2
EVAL_ANSWERS = 8  # answers the loss before / after training is measured on


class Interrupted(Exception):
    """Ctrl-C during a distillation: what was kept, and how to resume, is the message."""


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0
    seconds: float = 0.0
    curve: list[list[float]] = field(default_factory=list)  # [step, tokens, loss] per step


def add_lora(model: Any, rank: int, alpha: float, seed: int = 0) -> Any:
    """`model` with trainable LoRA adapters on its linear layers (all but the output layer); its
    own weights frozen. The adapters' random start is seeded (B = 0: the draft is unchanged)."""
    peft = peft_modules()
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear", bias="none"
    )
    with quiet_peft(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config)


def autocast_dtype(settings: DistillSettings, device: torch.device) -> torch.dtype | None:
    """bfloat16 autocast (`--autocast auto`) where the draft serves in bfloat16 (`--dtype`), the
    device computes in it and, on a CPU, `autocast_probe` measures it faster than float32;
    `bf16` asks for it whatever the speed, `off` trains in float32."""
    if settings.autocast == "off":
        return None
    if settings.autocast == "auto" and settings.dtype not in ("bfloat16", "bf16"):
        return None
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        if settings.autocast == "bf16":
            raise ValueError(f"--autocast bf16: {device} does not compute in bfloat16")
        return None
    if settings.autocast == "auto" and device.type == "cpu":
        times = autocast_probe(device)
        return torch.bfloat16 if times["bfloat16"] < times["float32"] else None
    return torch.bfloat16


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks above it still come from (and go back by) mmap
TRIM_THRESHOLD = 1 << 30  # free memory the heap keeps at its top before giving it back


@functools.cache
def keep_freed_memory(device: torch.device) -> bool:
    """Training on a CPU: make glibc's malloc keep the memory a step frees for the next step.
    A step allocates and frees many tensors of a few to tens of MB (activations, the loss's
    float32 logits and their gradients); by default glibc maps most of them fresh and gives them
    back, so every page faults in again at the next step, which costs more than the arithmetic
    on some machines (docs/results.md). Here blocks up to
    MMAP_THRESHOLD come from the heap, which keeps up to TRIM_THRESHOLD free for reuse; larger
    ones are still mapped and returned, which bounds what the heap's fragmentation can hold
    (with no mapping at all the resident peak grew by about a third, same section). Once per
    process; False where this is not glibc on Linux (nothing changed)."""
    if device.type != "cpu" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        return bool(done) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False


PROBE_ROWS, PROBE_FEATURES = 64, 1024  # one linear layer [64, 1024] x [1024, 1024]


@functools.cache
def autocast_probe(device: torch.device) -> dict[str, float]:
    """Milliseconds of one linear layer's forward and backward in float32 and under bfloat16
    autocast on `device` (the best of 3 after a warm-up): what `--autocast auto` decides by."""
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(PROBE_FEATURES, PROBE_FEATURES).to(device)
    x = torch.randn(PROBE_ROWS, PROBE_FEATURES, generator=gen).to(device).requires_grad_()
    times = {}
    for name, dtype in (("float32", None), ("bfloat16", torch.bfloat16)):
        best = float("inf")
        for _ in range(4):  # the first is a warm-up
            start = time.perf_counter()
            with autocast_context(device, dtype):
                out = layer(x)
            out.float().sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        times[name] = round(best * 1000, 3)
    return times


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def answers_digest(answers: Sequence[Answer]) -> str:
    """Which answers training sees, in order: part of what a checkpoint must match."""
    return hashlib.sha256("\n".join(a.key for a in answers).encode()).hexdigest()[:16]


def step_indices(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """The answers step `step` trains on: positions step·B .. step·B + B - 1 of the passes over
    `n` answers, each pass in its own seeded order."""
    out = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, index = divmod(position, n)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(int(order[index]))
    return out


def answer_loss(
    model: Any, answer: Answer, vocab: int, kind: str, device: torch.device, dtype: Any
) -> torch.Tensor:
    """The summed loss over one answer's positions (a 0-d tensor with its graph)."""
    return batch_loss(model, [answer], vocab, kind, device, dtype)


def batch_loss(
    model: Any,
    batch: Sequence[Answer],
    vocab: int,
    kind: str,
    device: torch.device,
    dtype: Any,
) -> torch.Tensor:
    """`answer_loss` summed over `batch`, from one forward over all of it: each answer's input
    (prompt + answer but its last token) right-padded to the longest, so every real position
    sees what it would alone (a causal model attends only to what comes before); the output
    layer and the loss run at the answer positions only, all rows together, a few positions at a
    time (`answer_logits`)."""
    inputs = [torch.cat([a.prompt_ids, a.answer_ids[:-1]]).long() for a in batch]  # [P + T - 1]
    width = max(len(x) for x in inputs)
    ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, width], padded with id 0
    for row, x in enumerate(inputs):
        ids[row, : len(x)] = x
    # answer a's positions are [P_a - 1, P_a - 1 + T_a): each predicts its next answer token
    rows = torch.cat([torch.full((a.tokens,), r) for r, a in enumerate(batch)])  # [N]
    cols = torch.cat([torch.arange(a.tokens) + len(a.prompt_ids) - 1 for a in batch])  # [N]
    top_logprobs = torch.cat([a.top_logprobs for a in batch]).to(device)  # [N, K]
    top_ids = torch.cat([a.top_ids for a in batch]).to(device)  # [N, K]
    tail = torch.cat([a.tail for a in batch]).to(device)  # [N]
    total = torch.zeros((), device=device)
    with autocast_context(device, dtype):
        for span, logits in answer_logits(model, ids.to(device), rows.to(device), cols.to(device)):
            losses = distill_loss(  # [n]
                logits[:, :vocab], top_logprobs[span], top_ids[span], tail[span], kind
            )
            total = total + losses.sum()
    return total


LOSS_PART_BYTES = 16 << 20  # a part's float32 logits: under keep_freed_memory's MMAP_THRESHOLD


def answer_logits(
    model: Any, ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor
) -> Iterator[tuple[slice, torch.Tensor]]:
    """The logits of `model` over `ids` [B, W] at positions (rows[n], cols[n]), n < N, a part
    at a time: (which n, their logits [n, V]). The body runs over every position, the output
    layer only at the picked positions and a few at a time: the logits over the vocabulary,
    their float32 copies and gradients are a step's largest tensors, and in parts each stays
    small enough for the C allocator to reuse rather than map fresh pages for at every step
    (`keep_freed_memory`). Models that change their logits after the output layer (a soft cap,
    a scale) run whole and are cut after."""
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        logits = model(input_ids=ids).logits[rows, cols]  # [N, V]
        for span in _parts(len(rows), logits.shape[-1]):
            yield span, logits[span]
        return
    picked = model.get_decoder()(input_ids=ids).last_hidden_state[rows, cols]  # [N, H]
    head = model.get_output_embeddings()
    weight, bias = head.weight, head.bias  # [V, H], [V] or None
    device = ids.device.type
    if torch.is_autocast_enabled(device):  # cast the frozen weight once, not once per part
        dtype = torch.get_autocast_dtype(device)
        weight, picked = weight.to(dtype), picked.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    for span in _parts(len(rows), weight.shape[0]):
        yield span, torch.nn.functional.linear(picked[span], weight, bias)


def _parts(n: int, vocab: int) -> Iterator[slice]:
    step = max(1, LOSS_PART_BYTES // (4 * vocab))
    return (slice(start, start + step) for start in range(0, n, step))


@torch.no_grad()
def mean_loss(
    model: Any, answers: Sequence[Answer], vocab: int, kind: str, device: torch.device, dtype: Any
) -> float:
    """The loss per token over `answers` (no training)."""
    total = sum(float(answer_loss(model, a, vocab, kind, device, dtype)) for a in answers)
    return total / max(1, sum(a.tokens for a in answers))


def _one_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    batch: Sequence[Answer],
    vocab: int,
    kind: str,
    device: torch.device,
    dtype: Any,
) -> float:
    """One optimizer step on `batch`; its loss per token."""
    optimizer.zero_grad(set_to_none=True)
    tokens = sum(a.tokens for a in batch)
    loss = batch_loss(model, batch, vocab, kind, device, dtype) / tokens
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return float(loss.detach())


class Checkpoints:
    """DIR/checkpoints/step-N.pt: write, find the newest, load (checking it is this run's).

    What of the model a checkpoint holds: its LoRA adapter's weights by default; `weights`
    (model -> state dict) and `load_weights` (model, state dict) for any other trained part
    (an EAGLE-3 head's, distill/eagle.py)."""

    def __init__(
        self,
        folder: Path,
        key: dict[str, Any],
        weights: Callable[[Any], dict[str, Any]] | None = None,
        load_weights: Callable[[Any, dict[str, Any]], Any] | None = None,
    ) -> None:
        self.folder, self.key = folder, key
        self._weights = weights or (lambda model: peft_modules().get_peft_model_state_dict(model))
        self._load_weights = load_weights or peft_set_state

    def paths(self) -> list[Path]:
        return sorted(self.folder.glob("step-*.pt")) if self.folder.exists() else []

    def save(self, model: Any, optimizer: torch.optim.Optimizer, state: TrainState) -> Path:
        path = self.folder / f"step-{state.step:07d}.pt"
        data = {
            "key": json.dumps(self.key, sort_keys=True),
            "state": state.__dict__,
            "lora": self._weights(model),
            "optimizer": optimizer.state_dict(),
        }
        save_tensors(path, data, f"checkpoint {path.name}")
        for old in self.paths()[:-KEEP_CHECKPOINTS]:
            old.unlink()
        return path

    def resume(self, model: Any, optimizer: torch.optim.Optimizer) -> TrainState | None:
        """The newest checkpoint loaded into `model` and `optimizer`, or None."""
        paths = self.paths()
        if not paths:
            return None
        data = load_tensors(paths[-1])
        held = json.loads(data["key"])
        if held != self.key:
            differ = sorted(k for k in {*held, *self.key} if held.get(k) != self.key.get(k))
            raise ValueError(
                f"{paths[-1]} was trained with other settings ({', '.join(differ)} differ): run "
                f"with the same settings to resume, or remove {self.folder} to train afresh"
            )
        self._load_weights(model, data["lora"])
        optimizer.load_state_dict(data["optimizer"])
        return TrainState(**data["state"])


def peft_set_state(model: Any, weights: dict[str, Any]) -> None:
    peft_modules().set_peft_model_state_dict(model, weights)


def training_record(
    settings: DistillSettings, state: TrainState, device: torch.device, autocast: Any
) -> dict[str, Any]:
    """What a finished training records whatever it trained (distill.json, eagle.json)."""
    return {
        "lr": settings.lr,
        "batch_size": settings.batch_size,
        "budget": settings.budget.text,
        "steps": state.step,
        "tokens": state.tokens,
        "seconds": round(state.seconds, 3),
        "tokens_per_s": round(state.tokens / state.seconds, 1) if state.seconds else None,
        "device": str(device),
        "autocast": str(autocast).removeprefix("torch.") if autocast else None,
        "malloc_keeps_freed": keep_freed_memory(device),
        "curve": state.curve,
    }


def too_small(budget: Budget, why: str) -> ValueError:
    return ValueError(
        f"--budget {budget.text} is too small for one training step ({why}): raise --budget, "
        "or lower --batch-size"
    )


def train(
    model: Any,
    answers: Sequence[Answer],
    settings: DistillSettings,
    vocab: int,
    device: torch.device,
    checkpoints: Checkpoints,
    progress: bool = True,
    one_step: Callable[[torch.optim.Optimizer, Sequence[Any]], float] | None = None,
) -> TrainState:
    """Train `model` (with its LoRA adapters) within the budget, resuming from `checkpoints`;
    the final state (also checkpointed). Interrupted on Ctrl-C, after a checkpoint.
    `one_step(optimizer, batch)`: one optimizer step on a batch of `answers` (anything with a
    `tokens` count), its loss per token; default: the LoRA draft's (`_one_step`)."""
    dtype = autocast_dtype(settings, device)
    if one_step is None:

        def one_step(optimizer: torch.optim.Optimizer, batch: Sequence[Any]) -> float:
            return _one_step(model, optimizer, batch, vocab, settings.loss, device, dtype)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    state = checkpoints.resume(model, optimizer) or TrainState()
    budget = settings.budget
    if budget.tokens is not None:  # the bar counts the budget: tokens or seconds
        total, done, unit = budget.tokens, min(state.tokens, budget.tokens), "tok"
    else:
        total, done, unit = round(budget.seconds or 0, 1), round(state.seconds, 1), "s"
    bar = tqdm(total=total, initial=done, unit=unit, desc="training", disable=not progress)
    model.train()
    try:
        while True:
            batch = [
                answers[i]
                for i in step_indices(state.step, len(answers), settings.batch_size, settings.seed)
            ]
            tokens = sum(a.tokens for a in batch)
            if budget.tokens is not None and state.tokens + tokens > budget.tokens:
                if state.step == 0:
                    raise too_small(budget, f"its first step trains {tokens} tokens")
                break
            mean_step = state.seconds / state.step if state.step else 0.0
            if (
                budget.seconds is not None
                and state.step
                and state.seconds + mean_step > budget.seconds
            ):
                break
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * min(1.0, (state.step + 1) / WARMUP_STEPS)
            start = time.perf_counter()
            loss = one_step(optimizer, batch)
            seconds = time.perf_counter() - start
            if budget.seconds is not None and state.step == 0 and seconds > budget.seconds:
                raise too_small(budget, f"the first step took {seconds:.1f} s")
            state.step += 1
            state.tokens += tokens
            state.seconds += seconds
            state.curve.append([state.step, state.tokens, round(loss, 6)])
            # a time budget's bar shows the seconds trained, rounded (no float sums on screen)
            bar.n = state.tokens if budget.tokens is not None else round(state.seconds, 1)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens / seconds:.0f}")  # refreshes
            if state.step % settings.checkpoint_every == 0:
                checkpoints.save(model, optimizer, state)
    except KeyboardInterrupt:
        bar.close()
        path = checkpoints.save(model, optimizer, state)
        raise Interrupted(
            f"interrupted at training step {state.step}: saved {path}. Run the same command "
            "again to resume from it (the data is cached in the --out folder)"
        ) from None
    bar.close()
    model.eval()
    checkpoints.save(model, optimizer, state)
    return state
