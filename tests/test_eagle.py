"""An EAGLE-style head (models/eagle_head.py, drafters/eagle.py, distill/eagle.py) on tiny random
float32 models: the target's caches keep exactly its features, `specdecode distill --kind eagle`
trains a head whose agreement with the target rises, the head loads as `eagle:DIR` and decodes
token for token as the target alone (alone, in a batch, over either cache), and bad input is
one clear message."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode import SpeculativeDecoder, load_model
from specdecode.cli import main
from specdecode.core.cache import KVCache, keep_features
from specdecode.core.decode import decode
from specdecode.core.draft_spec import DraftSpec
from specdecode.data.suites import load_suite
from specdecode.drafters import resolve_draft
from specdecode.drafters.eagle import EagleDrafter
from specdecode.models.eagle_head import EagleHead, read_head_record
from specdecode.models.lean import LeanCache
from test_distill import distill_args, pair  # noqa: F401  (the fixture, shared)

from conftest import needs_kernel, tiny_llama


@pytest.fixture(scope="module")
def head_dir(pair, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("eagle") / "run"
    assert main(distill_args(pair, out, "--kind", "eagle", budget="600")) == 0
    return out


@pytest.mark.parametrize("cache_class", [KVCache, LeanCache])
def test_the_targets_caches_keep_its_features(cache_class):
    model = tiny_llama(seed=3)
    keep_features(model)
    ids = torch.randint(0, 40, (14,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        whole = model(ids[None], output_hidden_states=True).hidden_states[-1][0]  # after the norm
        cache = cache_class(model)
        cache.forward(ids[:6], last_only=True)  # a prefill keeps every position's feature
        cache.forward(ids[6:11])
        cache.rollback(9)
        cache.forward(ids[9:])
    assert cache.features().shape == (14, whole.shape[1])
    torch.testing.assert_close(cache.features(), whole, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        cache.compact([0, 1, 2, 5, 9])
    torch.testing.assert_close(cache.features(), whole[[0, 1, 2, 5, 9]], atol=1e-5, rtol=1e-5)
    assert cache_class(tiny_llama(seed=3)).__class__ is cache_class  # others keep none
    with pytest.raises(ValueError, match="keeps no features"):
        cache_class(tiny_llama(seed=3)).features()


def test_the_head_learns_and_drafts_losslessly(pair, head_dir):  # noqa: F811
    record = read_head_record(head_dir)
    training = record["training"]
    assert record["kind"] == "eagle" and training["steps"] >= 5
    assert training["tokens"] <= 600  # the budget
    before, after = training["before"], training["after"]
    assert after["reg"] < before["reg"] and after["cls"] < before["cls"]
    assert after["top1"] > before["top1"]

    target = load_model(pair / "target", dtype="float32")
    drafter = resolve_draft(f"eagle:{head_dir}", target, dtype="float32")
    assert isinstance(drafter, EagleDrafter) and drafter.name == f"eagle:{head_dir}"
    assert 0 < drafter.cost_ratio < 1
    untrained = EagleHead.from_target(target.model)
    untrained.attach_output(target.model, None)
    ar = SpeculativeDecoder(target)
    accepted = {"trained": 0, "untrained": 0}
    prompts = [p.turns[0] for p in load_suite(pair / "prompts.jsonl")]
    for text in prompts:
        expected = ar.generate(text, max_new_tokens=20, chat=True).token_ids
        for name, d in (("trained", drafter), ("untrained", EagleDrafter(untrained, target.model))):
            out = SpeculativeDecoder(target, d, k=3, k_policy="fixed").generate(
                text, max_new_tokens=20, chat=True
            )
            assert out.token_ids == expected, (name, text)  # lossless
            accepted[name] += out.stats.accepted
    assert accepted["trained"] > accepted["untrained"]  # it learnt what the target says
    batch = SpeculativeDecoder(target, drafter, k=3, k_policy="fixed").generate_batch(
        prompts, max_new_tokens=20, chat=True
    )
    assert [r.token_ids for r in batch] == [
        ar.generate(text, max_new_tokens=20, chat=True).token_ids for text in prompts
    ]


def test_the_head_drafts_over_the_lean_cache_too():
    target = tiny_llama(seed=5)
    head = EagleHead.from_target(target)
    head.attach_output(target, None)
    drafter = EagleDrafter(head, target)
    prompt = [3, 7, 11, 2, 9, 4]
    expected = [t for block in decode(target, prompt, 24) for t in block]
    for new_cache in (KVCache, LeanCache):
        got = [
            t
            for block in decode(target, prompt, 24, drafter=drafter, k=3, new_cache=new_cache)
            for t in block
        ]
        assert got == expected, new_cache.__name__


def test_sampled_drafts_carry_their_distribution():
    from specdecode.core.sampling import SamplingParams

    target = tiny_llama(seed=5)
    head = EagleHead.from_target(target)
    head.attach_output(target, None)
    drafter = EagleDrafter(head, target)
    params = SamplingParams(temperature=0.8)
    gen = torch.Generator().manual_seed(0)
    steps = decode(target, [3, 7, 11], 16, drafter=drafter, k=3, params=params, generator=gen)
    out: list[int] = []
    for block in steps:  # left before the generator ends, which ends the drafter's sequence
        out += block
        if len(out) == 16:
            break
    draft = drafter.propose([3, 7, 11, *out], 2)
    steps.close()
    assert draft.q_draft is not None and draft.q_draft.shape[0] == 2
    torch.testing.assert_close(draft.q_draft.sum(-1), torch.ones(2))


def test_eagle_specs_parse_print_back_and_refuse_trees():
    spec = DraftSpec.parse("eagle:runs/e:int4")
    assert spec.kind == "eagle" and spec.eagle_dir == "runs/e" and str(spec) == "eagle:runs/e:int4"
    assert not spec.is_model_draft  # trees and --confidence need a draft model, so far
    for bad in ("eagle", "eagle:", "eagle:runs/e:int3"):
        with pytest.raises(ValueError, match="bad draft"):
            DraftSpec.parse(bad)


def test_a_head_folder_loads_only_whole_and_for_its_target(pair, head_dir, tmp_path):  # noqa: F811
    import shutil

    target = load_model(pair / "target", dtype="float32")
    with pytest.raises(ValueError, match="no such folder"):
        resolve_draft(f"eagle:{tmp_path / 'missing'}", target, dtype="float32")
    half = tmp_path / "half"
    shutil.copytree(head_dir, half)
    (half / "eagle.json").unlink()
    with pytest.raises(ValueError, match=r"no eagle\.json"):
        resolve_draft(f"eagle:{half}", target, dtype="float32")
    changed = tmp_path / "changed"
    shutil.copytree(head_dir, changed)
    with (changed / "head.safetensors").open("ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="changed or half-written"):
        resolve_draft(f"eagle:{changed}", target, dtype="float32")
    other = load_model(pair / "target", dtype="float32")
    other.model.config.hidden_size = 48  # a head's shapes follow its target's
    with pytest.raises(ValueError, match="not for this target"):
        resolve_draft(f"eagle:{head_dir}", other, dtype="float32")
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeDecoder(target, resolve_draft(f"eagle:{head_dir}", target, dtype="float32"),
                           tree="static:2,1")  # fmt: skip
    record = json.loads((head_dir / "eagle.json").read_text())
    assert record["target"] == str(pair / "target") and record["head"]["layers"] == 1


@needs_kernel()
def test_a_head_on_4bit_weights_drafts_for_a_bfloat16_target(pair, head_dir):  # noqa: F811
    from specdecode.kernels.quantize import is_quantized

    target = load_model(pair / "target", dtype="bfloat16")
    drafter = resolve_draft(f"eagle:{head_dir}:int4", target)
    assert isinstance(drafter, EagleDrafter) and drafter.name == f"eagle:{head_dir}:int4"
    # fc, the layer's seven projections and the output layer over the kept ids
    assert sum(is_quantized(m) for m in drafter.head.modules()) == 9
    text = load_suite(pair / "prompts.jsonl")[0].turns[0]
    expected = SpeculativeDecoder(target).generate(text, max_new_tokens=16, chat=True)
    out = SpeculativeDecoder(target, drafter, k=3, k_policy="fixed").generate(
        text, max_new_tokens=16, chat=True
    )
    assert out.token_ids == expected.token_ids


@needs_kernel()
def test_a_store_row_keeps_the_features_of_the_prefix_it_reuses():
    from specdecode.models.lean import VERIFY_TOKENS, LeanStore

    from conftest import WIDE, on_kernel

    target = on_kernel(tiny_llama(seed=0, layers=2, **WIDE))
    keep_features(target)
    gen = torch.Generator().manual_seed(1)
    shared, first, then = (torch.randint(0, 40, (n,), generator=gen) for n in (20, 12, 15))
    store = LeanStore(target, rows=1, max_len=96)
    row = store.open_row()
    with torch.inference_mode():
        row.forward(torch.cat([shared, first]), last_only=True)
    row.close()
    prompt = torch.cat([shared, then])
    row = store.open_row(prompt.tolist())
    assert len(row) == 20  # the shared prefix is kept, features included
    fresh = LeanCache(target, VERIFY_TOKENS, residual=store.residual)
    with torch.inference_mode():
        row.forward(prompt[20:], last_only=True)
        fresh.forward(prompt, last_only=True)
    assert torch.equal(row.features(), fresh.features())


def test_the_bench_counts_a_heads_weights_its_cache_and_the_kept_features():
    from specdecode.bench.memory import decode_bytes, kv_bytes_per_token, weights_bytes

    target = tiny_llama(seed=5)
    head = EagleHead.from_target(target)
    head.attach_output(target, None)
    drafter = EagleDrafter(head, target)
    n = 30
    alone = decode_bytes(target, None, n)
    hidden = target.config.hidden_size
    shared = weights_bytes(target) + weights_bytes(head) - weights_bytes(target, head)
    added = weights_bytes(head) - shared + kv_bytes_per_token(head.body) * n + hidden * 4 * n
    assert (
        kv_bytes_per_token(head.body)
        == kv_bytes_per_token(target) // target.config.num_hidden_layers
    )
    assert decode_bytes(target, drafter, n) == alone + added


def test_a_head_trains_without_peft(pair, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setitem(__import__("sys").modules, "peft", None)  # `import peft` fails
    out = tmp_path / "run"
    assert main(distill_args(pair, out, "--kind", "eagle", budget="40")) == 0
    record = read_head_record(out)
    assert "peft" not in record["versions"] and record["training"]["steps"] >= 1
