"""`specdecode distill`: a draft trained for its target on the target's own answers (LoRA
adapters, forward KL or total variation on the target's top-k distributions), usable wherever a
draft is named as `distilled:DIR` (draft_spec.py, drafters.resolve_draft).

settings.py (what a run does, its budget), prompts.py (the training / held-out split, prompts the
target writes itself), data.py (answers and distributions, cached in shards), loss.py, train.py
(LoRA training, checkpoints), result.py (the adapter and distill.json, written atomically; merged
into the base draft on loading), store.py (atomic writes, a full disk), run.py (the whole run),
cli_distill.py (the command).
"""
