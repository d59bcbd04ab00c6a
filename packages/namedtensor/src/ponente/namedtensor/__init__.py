"""Named tensors for JAX: axes are values, operations take axis names instead of positions.

The public API follows Haliax's, so ``import ponente.namedtensor as hax`` ports Haliax code.
"""

__version__ = "0.1.0"
