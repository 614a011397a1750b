"""Generation: sampling and ``generate``, the engine (continuous batching over cache slots) and the
OpenAI-style server (``kvm-serve``)."""
