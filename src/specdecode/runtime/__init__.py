"""The runtime: the engine (`SpeculativeDecoder`), the session that steps many generations over
one store, and the text stream; it assembles the providers (models, drafters, kernels) around the
core (docs/architecture.md, "The floors")."""
