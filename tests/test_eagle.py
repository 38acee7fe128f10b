"""EAGLE-3 heads (models/eagle_head.py, drafters/eagle.py, distill/eagle.py) on tiny random
float32 models: the target's caches keep exactly the hidden states asked for, a head written as
the published ones are (speculators' layout, the EAGLE repository's) loads as `eagle3:DIR` and
decodes token for token as the target alone (alone, in a batch, over either cache, on 4-bit
weights), `specdecode distill --kind eagle` trains a head in the same layout whose agreement
with the target rises, and a head for another target is refused with one line naming why."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_heads import eagle_repo_head, speculators_head
from specdecode import SpeculativeDecoder, load_model
from specdecode.cli import main
from specdecode.core.cache import KVCache, keep_features
from specdecode.core.decode import decode
from specdecode.core.draft_spec import DraftSpec
from specdecode.core.sampling import SamplingParams
from specdecode.data.suites import load_suite
from specdecode.distill.eagle import new_head, training_layers
from specdecode.drafters import resolve_draft
from specdecode.drafters.eagle import EagleDrafter, TreeEagleDrafter
from specdecode.drafters.factory import make_drafter
from specdecode.models.eagle_head import read_record, read_shape
from specdecode.models.lean import LeanCache
from specdecode.models.loading import wrap_model
from test_distill import distill_args, pair  # noqa: F401  (the fixture, shared)

from conftest import VOCAB, WIDE, needs_kernel, on_kernel, tiny_llama

PROMPT = [3, 7, 11, 2, 9, 4]


@pytest.fixture(scope="module")
def head_dir(pair, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("eagle") / "run"
    assert main(distill_args(pair, out, "--kind", "eagle", budget="600")) == 0
    return out


def _tokens(blocks) -> list[int]:
    return [t for block in blocks for t in block]


@pytest.mark.parametrize("cache_class", [KVCache, LeanCache])
def test_the_targets_caches_keep_the_hidden_states_asked_for(cache_class):
    model = tiny_llama(seed=3, layers=4)
    taps = keep_features(model, (1, 2, 2, 4))  # an index may repeat; 4: after the final norm
    assert taps.width == 4 * model.config.hidden_size
    ids = torch.randint(0, 40, (14,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        states = model(ids[None], output_hidden_states=True).hidden_states
        whole = torch.cat([states[i][0] for i in (1, 2, 2, 4)], dim=-1)  # [14, 4D]
        cache = cache_class(model)
        cache.forward(ids[:6], last_only=True)  # a prefill keeps every position's features
        cache.forward(ids[6:11])
        cache.rollback(9)
        cache.forward(ids[9:])
    torch.testing.assert_close(cache.features(), whole, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        cache.compact([0, 1, 2, 5, 9])
    torch.testing.assert_close(cache.features(), whole[[0, 1, 2, 5, 9]], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="already keeps"):
        keep_features(model, (1, 2))  # one set a target
    with pytest.raises(ValueError, match="from 0"):
        keep_features(tiny_llama(seed=3, layers=4), (1, 5))
    with pytest.raises(ValueError, match="keeps no features"):
        cache_class(tiny_llama(seed=3)).features()


@pytest.mark.parametrize("layout", [speculators_head, eagle_repo_head])
def test_a_published_head_loads_and_drafts_losslessly(layout, tmp_path):
    target = wrap_model(tiny_llama(seed=5, layers=6))
    folder = layout(tmp_path / "head", target.model, draft_vocab=VOCAB // 2)
    drafter = resolve_draft(f"eagle3:{folder}", target, dtype="float32")
    assert isinstance(drafter, EagleDrafter) and drafter.name == f"eagle3:{folder}"
    assert drafter.head.aux_layers == ((1, 3, 5) if layout is speculators_head else (2, 3, 3))
    assert 0 < drafter.cost_ratio < 1
    expected = _tokens(decode(target.model, PROMPT, 24))
    for new_cache in (KVCache, LeanCache):
        got = _tokens(decode(target.model, PROMPT, 24, drafter=drafter, k=3, new_cache=new_cache))
        assert got == expected, new_cache.__name__
    # a drafted token is the target id d + d2t[d] of the draft id d the head chose
    ids = drafter.head.target_ids()
    assert ids.numel() == VOCAB // 2 and len(set(ids.tolist())) == ids.numel()
    drafter.head.draft_logits = lambda h: torch.nn.functional.one_hot(
        torch.tensor([7]), ids.numel()
    ).float()
    steps = decode(target.model, PROMPT, 8, drafter=drafter, k=2)
    next(steps)
    assert drafter.propose([*PROMPT, 1], 2).tokens.tolist() == [int(ids[7])] * 2
    steps.close()


@pytest.mark.parametrize("tree", ["static:2,2,1", "dynamic:6,3,2"])
def test_a_published_head_grows_trees_losslessly(tree, tmp_path):
    target = wrap_model(tiny_llama(seed=5, layers=6))
    folder = speculators_head(tmp_path / "head", target.model, draft_vocab=VOCAB // 2)
    head = resolve_draft(f"eagle3:{folder}", target, dtype="float32")
    drafter = make_drafter(head, target, tree=tree)
    assert isinstance(drafter, TreeEagleDrafter) and drafter.name == f"eagle3:{folder} tree {tree}"
    expected = _tokens(decode(target.model, PROMPT, 24))
    for new_cache in (KVCache, LeanCache):
        got = _tokens(decode(target.model, PROMPT, 24, drafter=drafter, new_cache=new_cache))
        assert got == expected, new_cache.__name__
    from specdecode.bench.methods import plan_settings

    planned = plan_settings(["spec"], {"head": head}, [2], ["fixed"], [tree])
    assert [x.tree for x in planned] == [None, tree]  # the bench grows a head's trees too
    gen = torch.Generator().manual_seed(0)  # sampled: each node's q over the target's ids
    steps = decode(target.model, PROMPT, 12, drafter=drafter, params=SamplingParams(0.8),
                   generator=gen)  # fmt: skip
    first = next(steps)  # the prefill's token: the target's cache covers the prompt
    grown = drafter.propose_tree([*PROMPT, *first], 3)
    steps.close()
    assert grown.q_draft is not None and len(grown) >= 2
    torch.testing.assert_close(grown.q_draft.sum(-1), torch.ones(len(grown)))
    mapped = torch.zeros(VOCAB, dtype=torch.bool)
    mapped[drafter.head.target_ids()] = True
    assert all(mapped[t] for t in grown.tokens.tolist())


def test_sampled_drafts_carry_their_distribution_over_the_target_ids(tmp_path):
    target = tiny_llama(seed=5, layers=6)
    folder = speculators_head(tmp_path / "head", target, draft_vocab=VOCAB // 2)
    drafter = resolve_draft(f"eagle3:{folder}", wrap_model(target), dtype="float32")
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.8)
    steps = decode(target, [3, 7, 11], 16, drafter=drafter, k=3, params=params, generator=gen)
    out: list[int] = []
    for block in steps:  # left before the generator ends, which ends the drafter's sequence
        out += block
        if len(out) >= 16:
            break
    draft = drafter.propose([3, 7, 11, *out], 2)
    steps.close()
    assert draft.q_draft is not None and draft.q_draft.shape == (2, VOCAB)
    torch.testing.assert_close(draft.q_draft.sum(-1), torch.ones(2))
    mapped = torch.zeros(VOCAB, dtype=torch.bool)
    mapped[drafter.head.target_ids()] = True
    assert float(draft.q_draft[:, ~mapped].sum()) == 0  # only what the head can draft
    assert all(mapped[t] for t in draft.tokens.tolist())


def test_a_head_for_another_target_is_refused_with_the_mismatch(tmp_path):
    target = wrap_model(tiny_llama(seed=5, layers=6))
    cases = {
        "hidden size 32.*this target's is 48": tiny_llama(seed=5, layers=6, hidden_size=48),
        "vocabulary of 96 tokens.*has 120": tiny_llama(seed=5, layers=6, vocab=120),
        "hidden states \\[1, 3, 5\\].* 4 layers": tiny_llama(seed=5, layers=4),
    }
    folder = speculators_head(tmp_path / "head", target.model, draft_vocab=VOCAB // 2)
    for why, other in cases.items():
        with pytest.raises(ValueError, match=f"for another target: .*{why}"):
            resolve_draft(f"eagle3:{folder}", wrap_model(other), dtype="float32")
    message = "Llama-3.1-8B-Instruct"  # the verifier the config names is in the message
    with pytest.raises(ValueError, match=message):
        resolve_draft(
            f"eagle3:{folder}",
            wrap_model(tiny_llama(seed=5, layers=6, hidden_size=48)),
            dtype="float32",
        )
    with pytest.raises(ValueError, match="no such folder"):
        resolve_draft(f"eagle3:{tmp_path / 'missing'}", target, dtype="float32")
    (tmp_path / "not").mkdir()
    (tmp_path / "not" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not an EAGLE-3 head's config"):
        resolve_draft(f"eagle3:{tmp_path / 'not'}", target, dtype="float32")
    deeper = json.loads((folder / "config.json").read_text())
    deeper["transformer_layer_config"]["num_hidden_layers"] = 2
    (tmp_path / "not" / "config.json").write_text(json.dumps(deeper))
    with pytest.raises(ValueError, match="a head of 2 decoder layers"):
        resolve_draft(f"eagle3:{tmp_path / 'not'}", target, dtype="float32")
    (tmp_path / "not" / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        resolve_draft(f"eagle3:{tmp_path / 'not'}", target, dtype="float32")
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    del weights["layers.0.hidden_norm.weight"]
    save_file(weights, str(tmp_path / "not" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"not an EAGLE-3 head's .*hidden_norm"):
        resolve_draft(f"eagle3:{tmp_path / 'not'}", target, dtype="float32")


def test_the_command_line_says_what_the_head_is(pair, tmp_path, capsys):  # noqa: F811
    target = load_model(pair / "target", dtype="float32")
    folder = speculators_head(tmp_path / "head", target.model, draft_vocab=20)
    argv = ["generate", "--target", str(pair / "target"), "--draft", f"eagle3:{folder}"]
    assert main([*argv, "--dtype", "float32", "--prompt", "hello", "--max-new-tokens", "6"]) == 0
    err = capsys.readouterr().err
    assert (
        f"draft eagle3:{folder}: an EAGLE-3 head over the target's hidden states [1, 1, 1], "
        f"drafting 20 of its {target.model.config.vocab_size} tokens, made for "
        "meta-llama/Llama-3.1-8B-Instruct" in err
    )


def test_eagle_specs_parse_print_back():
    spec = DraftSpec.parse("eagle3:runs/e:int4")
    assert spec.kind == "eagle" and spec.eagle_dir == "runs/e" and str(spec) == "eagle3:runs/e:int4"
    assert DraftSpec.parse("eagle:runs/e:int4") == spec  # the older prefix reads the same
    assert spec.drafts_trees and not spec.is_model_draft  # a head has no --confidence yet
    for bad in ("eagle3", "eagle3:", "eagle:", "eagle3:runs/e:int3"):
        with pytest.raises(ValueError, match="bad draft"):
            DraftSpec.parse(bad)


def test_distill_writes_a_head_in_the_published_layout_that_learns(pair, head_dir):  # noqa: F811
    record = read_record(head_dir)
    assert record is not None and record["kind"] == "eagle"
    training = record["training"]
    assert training["steps"] >= 5 and training["tokens"] <= 600  # the budget
    before, after = training["before"], training["after"]
    assert after["cls"] < before["cls"] and after["top1"] > before["top1"]
    config = json.loads((head_dir / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(pair / "target")
    shape = read_shape(config, "the head")
    assert shape.aux_layers == training_layers(2) == (0, 1, 1)

    target = load_model(pair / "target", dtype="float32")
    drafter = resolve_draft(f"eagle3:{head_dir}", target, dtype="float32")
    assert isinstance(drafter, EagleDrafter)
    keep = drafter.head.target_ids()
    untrained = EagleDrafter(new_head(target.model, shape.aux_layers, keep, "x"), target.model)
    ar = SpeculativeDecoder(target)
    accepted = {"trained": 0, "untrained": 0}
    prompts = [p.turns[0] for p in load_suite(pair / "prompts.jsonl")]
    for text in prompts:
        expected = ar.generate(text, max_new_tokens=20, chat=True).token_ids
        for name, d in (("trained", drafter), ("untrained", untrained)):
            out = SpeculativeDecoder(target, d, k=3, k_policy="fixed").generate(
                text, max_new_tokens=20, chat=True
            )
            assert out.token_ids == expected, (name, text)  # lossless
            accepted[name] += out.stats.accepted
    assert accepted["trained"] > accepted["untrained"]  # it learnt what the target says
    batch = SpeculativeDecoder(target, drafter, k=3, k_policy="fixed").generate_batch(
        prompts, max_new_tokens=20, chat=True
    )
    expected = [ar.generate(text, max_new_tokens=20, chat=True).token_ids for text in prompts]
    assert [r.token_ids for r in batch] == expected
    tree = SpeculativeDecoder(target, drafter, tree="dynamic:6,4,2")
    assert isinstance(tree.drafter, TreeEagleDrafter)
    outs = [tree.generate(text, max_new_tokens=20, chat=True) for text in prompts]
    assert [o.token_ids for o in outs] == expected  # trees too, and they are accepted
    assert sum(o.stats.accepted for o in outs) > 0


def test_a_trained_head_folder_loads_only_whole(pair, head_dir, tmp_path):  # noqa: F811
    import shutil

    target = load_model(pair / "target", dtype="float32")
    changed = tmp_path / "changed"
    shutil.copytree(head_dir, changed)
    with (changed / "model.safetensors").open("ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="changed or half-written"):
        resolve_draft(f"eagle3:{changed}", target, dtype="float32")
    old = tmp_path / "old"
    shutil.copytree(head_dir, old)
    (old / "eagle.json").write_text(json.dumps({"format": 1}))  # an EAGLE-1 head's record
    with pytest.raises(ValueError, match="older kind"):
        resolve_draft(f"eagle3:{old}", target, dtype="float32")


@needs_kernel()
def test_a_head_on_4bit_weights_drafts_for_a_bfloat16_target(pair, head_dir):  # noqa: F811
    from specdecode.kernels.quantize import is_quantized

    target = load_model(pair / "target", dtype="bfloat16")
    drafter = resolve_draft(f"eagle3:{head_dir}:int4", target)
    assert isinstance(drafter, EagleDrafter) and drafter.name == f"eagle3:{head_dir}:int4"
    # fc, the layer's seven projections and lm_head
    assert sum(is_quantized(m) for m in drafter.head.modules()) == 9
    text = load_suite(pair / "prompts.jsonl")[0].turns[0]
    expected = SpeculativeDecoder(target).generate(text, max_new_tokens=16, chat=True)
    out = SpeculativeDecoder(target, drafter, k=3, k_policy="fixed").generate(
        text, max_new_tokens=16, chat=True
    )
    assert out.token_ids == expected.token_ids


@needs_kernel()
def test_a_published_head_drafts_for_a_4bit_target_on_the_lean_forward(tmp_path):
    plain = tiny_llama(seed=2, layers=6, **WIDE)
    folder = eagle_repo_head(tmp_path / "head", plain, draft_vocab=VOCAB // 2)
    target = on_kernel(tiny_llama(seed=2, layers=6, **WIDE), bits=4)  # the same, 4-bit
    drafter = resolve_draft(f"eagle3:{folder}", wrap_model(target))
    expected = _tokens(decode(target, PROMPT, 20, new_cache=LeanCache))
    got = _tokens(decode(target, PROMPT, 20, drafter=drafter, k=3, new_cache=LeanCache))
    assert got == expected


@needs_kernel()
def test_a_store_row_keeps_the_features_of_the_prefix_it_reuses(monkeypatch):
    from specdecode.models import lean
    from specdecode.models.lean import VERIFY_TOKENS, LeanStore

    target = on_kernel(tiny_llama(seed=0, layers=4, **WIDE))
    keep_features(target, (0, 2, 3))
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
    assert row.features().shape[1] == 3 * target.config.hidden_size
    assert torch.equal(row.features(), fresh.features())
    with torch.inference_mode():  # decode steps: the layer loop in one C++ call taps too
        for token in then[:3]:
            fresh.forward(token.view(1))
    monkeypatch.setattr(lean, "NATIVE_LOOP", False)  # ... the same as the loop in Python
    looped = LeanCache(target, VERIFY_TOKENS, residual=store.residual)
    with torch.inference_mode():
        looped.forward(prompt, last_only=True)
        for token in then[:3]:
            looped.forward(token.view(1))
    assert torch.equal(looped.features(), fresh.features())


def test_the_bench_counts_a_heads_weights_its_cache_and_the_kept_features(tmp_path):
    from specdecode.bench.memory import decode_bytes, kv_bytes_per_token, weights_bytes

    target = tiny_llama(seed=5, layers=6)
    folder = eagle_repo_head(tmp_path / "head", target, draft_vocab=VOCAB // 2)
    drafter = resolve_draft(f"eagle3:{folder}", wrap_model(target), dtype="float32")
    head, n = drafter.head, 30
    alone = decode_bytes(target, None, n)
    hidden = target.config.hidden_size
    shared = weights_bytes(target) + weights_bytes(head) - weights_bytes(target, head)
    per_token = kv_bytes_per_token(target) // target.config.num_hidden_layers  # one layer's
    added = weights_bytes(head) - shared + per_token * n + 3 * hidden * 4 * n
    assert decode_bytes(target, drafter, n) == alone + added


def test_a_head_trains_without_peft(pair, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setitem(__import__("sys").modules, "peft", None)  # `import peft` fails
    out = tmp_path / "run"
    assert main(distill_args(pair, out, "--kind", "eagle", budget="40")) == 0
    record = read_record(out)
    assert record is not None
    assert "peft" not in record["versions"] and record["training"]["steps"] >= 1
