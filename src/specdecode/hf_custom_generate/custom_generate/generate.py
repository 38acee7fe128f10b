"""specdecode's speculative decoding behind transformers' `custom_generate` hook, as a local repo.

    model.generate(**inputs, assistant_model=draft, trust_remote_code=True,
                   custom_generate=specdecode.hf_generate.CUSTOM_GENERATE)

transformers loads this file and calls `generate(model=..., **generate's arguments)`; the work is
done by `specdecode.hf_generate` (docs there).
"""

from specdecode.hf_generate import generate_with_assistant as generate

__all__ = ["generate"]
