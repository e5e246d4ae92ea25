"""Heterogeneous Spot training of Vision Transformers: spec, data plane, trainer, launcher.

Importing this package is cheap (no torch); each submodule imports what it needs.
"""

__version__ = "0.1.0"
