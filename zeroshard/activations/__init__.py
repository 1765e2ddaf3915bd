"""Activation checkpointing: recompute a block's activations in backward instead of keeping them."""
