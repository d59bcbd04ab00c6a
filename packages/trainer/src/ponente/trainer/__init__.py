"""Training for ``ponente.models``: configuration, loop, optimizers, checkpoints, trackers, entry points."""

__version__ = "0.1.0"
