"""Checkpoints that DeepSpeed wrote, read without DeepSpeed: its pickles read as data (unpickle.py), its
flat partitions turned back into whole parameters and moments (partitions.py), and the whole behind
the loader's reader interface (reader.py), so ``engine.load_checkpoint`` reshards them like its own."""

from .reader import DeepSpeedReader, deepspeed_directory
from .unpickle import DeepSpeedPickleError, load_deepspeed_file

__all__ = ["DeepSpeedReader", "deepspeed_directory", "DeepSpeedPickleError", "load_deepspeed_file"]
