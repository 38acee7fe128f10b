"""The decoding core: types, sampling, verification, token trees, the drafter protocols, the step,
the batch, the policies, the caches and the store (docs/architecture.md, "The floors").

Pure data in, data out: nothing here prints, reads a clock for reporting, loads a model or imports
a kernel, a drafter implementation, the runtime or an app (the import contract in pyproject.toml).
"""
