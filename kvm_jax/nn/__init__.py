"""Flax NNX modules (mixers, GPTAlpha-2 blocks, LM). Lands with the model issue (#3)."""
