"""A zoo of foundation models written with ``ponente.namedtensor``, with Hugging Face import/export."""

__version__ = "0.1.0"
