"""Synchronous data-parallel SGD: ``python -m allreduce_kit.train`` (see docs/training.md)."""
