"""Command-line entry points (``python -m ponente.trainer.main.<name>``)."""
