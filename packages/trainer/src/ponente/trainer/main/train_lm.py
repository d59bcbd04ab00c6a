"""Train a language model: ``python -m ponente.trainer.main.train_lm`` (also ``ponente-train``).

Until the training loop lands, this entry point reports what would run it: the versions of the
Ponente packages, their runtime libraries, and the JAX devices it sees.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ponente.trainer.versions import ponente_versions, runtime_versions


def main(argv: Sequence[str] | None = None) -> int:
    """Run the entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="ponente-train",
        description="Train a language model with Ponente. (The training loop is not implemented yet: "
        "for now this prints the installed Ponente packages and the JAX devices.)",
    )
    parser.parse_args(argv)

    import jax

    for dist, version in ponente_versions().items():
        print(f"{dist} {version}")
    for dist, version in runtime_versions().items():
        print(f"  {dist} {version}")
    devices = jax.devices()
    print(f"JAX backend: {jax.default_backend()} with {len(devices)} device(s): {', '.join(map(str, devices))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
