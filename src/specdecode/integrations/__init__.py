"""Our drafters inside other engines (vllm.py: proposers for vLLM's `custom_class` method)."""
