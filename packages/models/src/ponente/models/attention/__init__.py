"""Attention for the model zoo: the layer, its backends, the mask and the key/value cache of decoding.

One module per concept, from the top (the layer every family uses) to the bottom (what every backend reads):

- :class:`Attention` (grouped-query attention with rotary embeddings), :func:`attention` (one call computed by
  the chosen backend) and :func:`decode_attention` (queries over a :class:`KvCache`);
- :mod:`~ponente.models.attention.backends`: the backends by name, what each supports, how ``"auto"`` picks one;
- one module per kernel family: :mod:`~ponente.models.attention.flash` (blockwise, pure JAX),
  :mod:`~ponente.models.attention.jax_nn` (``jax.nn.dot_product_attention``: XLA and cuDNN),
  :mod:`~ponente.models.attention.pallas` (JAX's Pallas kernels) and :mod:`~ponente.models.attention.reference`
  (materialized scores: the definition the others are tested against, :func:`dot_product_attention`);
- :class:`AttentionMask` (causal, sliding window, segment ids; a description materialized on demand) and
  :mod:`~ponente.models.attention.kv_cache` (:class:`KvCache`, and :class:`PagedKvCache`, its paged form).

"""

from ._layer import ATTENTION_BACKENDS, KEY_POSITION, Attention, attention, decode_attention, dot_product_attention
from ._mask import AttentionMask
from .kv_cache import KvCache, PagedKvCache

__all__ = [
    "ATTENTION_BACKENDS",
    "KEY_POSITION",
    "Attention",
    "AttentionMask",
    "KvCache",
    "PagedKvCache",
    "attention",
    "decode_attention",
    "dot_product_attention",
]
