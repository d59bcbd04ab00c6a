"""The attention backends by name, what each supports, and how ``"auto"`` picks one per device and call.

:data:`BACKENDS` maps a name to an :class:`AttentionBackend`: the function that computes attention (all with the
contract of :func:`~ponente.models.attention.attention`) and a ``supports`` check that says, from the static
facts of a call (:class:`~ponente.models.attention.backends.AttentionCall`: device, dtype, shapes, mask features),
whether the backend computes it, or why not.

=============  ==========  =======  =====  ========  ========  ========  =====  ====================================
backend        runs on     causal   GQA    window    segments  soft cap  sinks  notes
=============  ==========  =======  =====  ========  ========  ========  =====  ====================================
``reference``  anywhere    yes      yes    yes       yes       yes       yes    materializes the scores; explicit masks
``flash``      anywhere    yes      yes    yes       yes       yes       yes    pure-JAX blockwise, O(seq * block)
``xla``        anywhere    yes      yes    yes       yes       no        no     ``jax.nn.dot_product_attention``
``cudnn``      NVIDIA GPU  yes      yes    yes       yes [1]   no        no     bf16/fp16, head size % 8, <= 128
``pallas``     GPU, TPU    yes      yes    TPU only  yes       TPU only  no     Triton (GPU), splash (TPU) kernels
=============  ==========  =======  =====  ========  ========  ========  =====  ====================================

[1] as an additive ``(batch, 1, position, key_position)`` bias. Only ``reference`` and ``xla`` take an explicit
boolean mask. Attention sinks (a per-head logit in the softmax's denominator, gpt-oss) are computed by ``reference``
and ``flash``; the others refuse a call with sinks, so ``auto`` picks one of those two for it.

``"auto"`` (:func:`auto_backend`) is decided statically, never by trying: it walks the device's preference list
(:data:`AUTO_PREFERENCE`, or :data:`SHORT_SEQ_PREFERENCE`'s below its length) and takes the first backend that
supports the call, skipping ``flash`` below the device's :data:`FLASH_MIN_SEQ_LEN` (where materialized scores are
both faster and small); ``reference``, which supports everything, ends every list. On an NVIDIA GPU that means
cuDNN from 2048 positions, the Triton kernel below (both measured on an H100 by the ``attention`` benchmark), then
whichever of them supports the call (a sliding window: cuDNN; float32 or head sizes over 128: Triton).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from ponente.namedtensor import Axis, NamedArray

from ._call import AttentionCall
from ._mask import AttentionMask
from .flash import flash_attention
from .jax_nn import cudnn_attention, cudnn_supports, xla_attention, xla_supports
from .pallas import pallas_attention, pallas_supports
from .reference import reference_attention

__all__ = [
    "ATTENTION_BACKENDS",
    "AUTO_PREFERENCE",
    "BACKENDS",
    "FLASH_MIN_SEQ_LEN",
    "SHORT_SEQ_PREFERENCE",
    "AttentionBackend",
    "AttentionCall",
    "AttentionFn",
    "auto_backend",
    "check_backend_name",
    "check_sinks_backend",
    "check_soft_cap_backend",
    "resolve_backend",
]


class AttentionFn(Protocol):
    """The signature every backend implements (that of :func:`~ponente.models.attention.attention`)."""

    def __call__(
        self,
        Pos: Axis,
        HeadSize: Axis,
        query: NamedArray,
        key: NamedArray,
        value: NamedArray,
        mask: AttentionMask | NamedArray | None,
        *,
        scaling_factor: float | None = None,
        block_size: int = 128,
        logit_soft_cap: float | None = None,
        sinks: NamedArray | None = None,
    ) -> NamedArray: ...


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One attention backend.

    Attributes:
        fn: computes attention.
        supports: None if the backend computes the call, else a phrase saying what it does not support.
        soft_cap: whether it can soft-cap logits on some device (lets configs reject a hopeless choice early).
        sinks: whether it computes attention sinks (checked for every backend before ``supports``).
    """

    fn: AttentionFn
    supports: Callable[[AttentionCall], str | None]
    soft_cap: bool = False
    sinks: bool = False

    def refuses(self, call: AttentionCall) -> str | None:
        """None if the backend computes ``call``, else a phrase saying what it does not support."""
        if call.sinks and not self.sinks:
            return "attention sinks (only 'reference' and 'flash' compute them)"
        if call.token_index and self.fn not in (reference_attention, flash_attention):
            return "a mask ordered by token indices (context parallelism's zig-zag split; 'reference' and 'flash')"
        return self.supports(call)


def _flash_supports(call: AttentionCall) -> str | None:
    if call.explicit_mask:
        return "an explicit NamedArray mask (it computes the mask per block; pass an AttentionMask)"
    return None


BACKENDS: dict[str, AttentionBackend] = {
    "reference": AttentionBackend(reference_attention, lambda call: None, soft_cap=True, sinks=True),
    "flash": AttentionBackend(flash_attention, _flash_supports, soft_cap=True, sinks=True),
    "xla": AttentionBackend(xla_attention, xla_supports),
    "cudnn": AttentionBackend(cudnn_attention, cudnn_supports),
    "pallas": AttentionBackend(pallas_attention, pallas_supports, soft_cap=True),
}
"""The attention backends by name."""

ATTENTION_BACKENDS = ("auto", *BACKENDS)
"""The names accepted by :func:`~ponente.models.attention.attention`'s ``backend`` (and ``LmConfig.attn_backend``)."""

AUTO_PREFERENCE: dict[str, tuple[str, ...]] = {
    # measured by the ``attention`` benchmark on one H100 (benchmarks/README.md): cuDNN's fused kernel is the fastest
    # from 2048 positions (0.17-0.33x the materialized reference's time, causal; 0.25-0.48x with packed segment
    # ids), Triton second (0.44-0.57x); the pure-JAX flash is 10-13x slower than the reference there, so it is only
    # taken for memory (see FLASH_MIN_SEQ_LEN)
    "gpu": ("cudnn", "pallas", "flash", "reference"),
    # splash attention handles every feature; pending TPU measurements
    "tpu": ("pallas", "flash", "reference"),
    # measured by the ``attention`` benchmark on a 2-core CPU (see FLASH_MIN_SEQ_LEN); ``xla`` measured slower than
    # ``flash`` at every length
    "cpu": ("flash", "reference"),
}
"""Per device platform, the backends ``auto`` tries in order (unknown platforms use ``"cpu"``'s)."""

SHORT_SEQ_PREFERENCE: dict[str, tuple[int, tuple[str, ...]]] = {
    # one H100, causal, one sequence of Llama-3.2-1B's attention: Triton 0.198 ms vs cuDNN 0.239 ms at 512
    # positions, 0.321 vs 0.360 ms at 1024; cuDNN ahead from 2048 (0.574 vs 0.845 ms)
    "gpu": (2048, ("pallas", "cudnn", "flash", "reference")),
}
"""Per platform, ``(length, preference)``: below ``length`` positions ``auto`` tries ``preference`` instead of
:data:`AUTO_PREFERENCE`'s list."""

FLASH_MIN_SEQ_LEN: dict[str, int] = {"gpu": 8192, "tpu": 8192, "cpu": 256}
"""Per platform, the shortest sequence for which ``auto`` takes ``flash`` (shorter: materialized scores).

On GPU/TPU only memory argues for it (scores of 8192² per head); materialized scores are faster there. On a CPU the
``attention`` benchmark (causal GQA, head size 64, float32, 2 loaded cores) measured flash/reference forward+backward
time 0.75 at 64 positions, 0.57 at 128, 0.53 at 256 and 0.07-0.15 from 512 to 4096 (benchmarks/README.md); below
256 positions the gain is small in absolute terms and the reference program is simpler to compile.
"""


def auto_backend(call: AttentionCall) -> str:
    """The backend ``"auto"`` resolves to for ``call``: the first supporting one in the device's preference list.

    Args:
        call: the static facts of the call (device, dtype, shapes, mask features).

    Returns:
        A key of :data:`BACKENDS`.

    Example:
        >>> auto_backend(AttentionCall("gpu", "bfloat16", seq_len=2048, head_size=64))
        'cudnn'
        >>> auto_backend(AttentionCall("gpu", "bfloat16", seq_len=1024, head_size=64))
        'pallas'
        >>> auto_backend(AttentionCall("gpu", "float32", seq_len=2048, head_size=64))
        'pallas'
        >>> auto_backend(AttentionCall("gpu", "bfloat16", seq_len=2048, head_size=64, soft_cap=True))
        'reference'
    """
    preference = AUTO_PREFERENCE.get(call.platform, AUTO_PREFERENCE["cpu"])
    short = SHORT_SEQ_PREFERENCE.get(call.platform)
    if short is not None and call.seq_len < short[0]:
        preference = short[1]
    min_flash = FLASH_MIN_SEQ_LEN.get(call.platform, FLASH_MIN_SEQ_LEN["cpu"])
    for name in preference:
        if name == "flash" and call.seq_len < min_flash:
            continue
        if BACKENDS[name].refuses(call) is None:
            return name
    return "reference"


def check_backend_name(name: str, where: str) -> None:
    """Raise if ``name`` is not ``"auto"`` or a key of :data:`BACKENDS`.

    Raises:
        ValueError: naming ``where`` and listing the choices.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"{where}: unknown attention backend {name!r}; choose one of {list(ATTENTION_BACKENDS)}")


def check_soft_cap_backend(name: str, where: str) -> None:
    """Raise early if the backend ``name`` can never soft-cap logits (``"auto"`` always picks one that can).

    Raises:
        ValueError: naming ``where`` and the backends that can.
    """
    check_backend_name(name, where)
    if name != "auto" and not BACKENDS[name].soft_cap:
        able = ["auto", *(n for n, b in BACKENDS.items() if b.soft_cap)]
        raise ValueError(f"{where}: the {name!r} attention backend has no logit soft-capping; use one of {able}")


def check_sinks_backend(name: str, where: str) -> None:
    """Raise early if the backend ``name`` cannot compute attention sinks (``"auto"`` always picks one that can).

    Raises:
        ValueError: naming ``where`` and the backends that can.
    """
    check_backend_name(name, where)
    if name != "auto" and not BACKENDS[name].sinks:
        able = ["auto", *(n for n, b in BACKENDS.items() if b.sinks)]
        raise ValueError(f"{where}: the {name!r} attention backend has no attention sinks; use one of {able}")


def resolve_backend(name: str, call: AttentionCall) -> AttentionBackend:
    """The backend that computes ``call`` when ``name`` is asked for (``"auto"``: :func:`auto_backend`).

    Args:
        name: ``"auto"`` or a key of :data:`BACKENDS`.
        call: the static facts of the call.

    Returns:
        The backend.

    Raises:
        ValueError: for an unknown name, or a backend that does not support the call (the message names the
            unsupported feature or device, and what ``auto`` would pick instead).
    """
    check_backend_name(name, "attention")
    chosen = auto_backend(call) if name == "auto" else name
    backend = BACKENDS[chosen]
    reason = backend.refuses(call)
    if reason is not None:
        raise ValueError(
            f"attention backend {chosen!r} does not support {reason}; backend='auto' would use "
            f"{auto_backend(call)!r} here"
        )
    return backend
