"""Adapters (named training outputs with an owner) and the index of their published checkpoints."""
