"""A zoo of foundation models written with ``ponente.namedtensor``, with Hugging Face import/export.

What users import, by concept: the model interface (:mod:`~ponente.models.lm`) and its configs
(:mod:`~ponente.models.config`), the losses (:mod:`~ponente.models.loss`), attention and the KV cache
(:mod:`~ponente.models.attention`), shared blocks (rotary, mixture of experts), the families, LoRA and the
checkpoint names of the blocks. ``ponente.models.hf`` reads and writes Hugging Face checkpoints.

``attention.attention`` is not re-exported here: the function would shadow the subpackage
(``ponente.models.attention`` would stop being a package); import it, and ``attention.flash.flash_attention``, from
the subpackage.
"""

from .attention import ATTENTION_BACKENDS, Attention, AttentionMask, KvCache, PagedKvCache, dot_product_attention
from .config import (
    LmConfig,
    config_for_type,
    lm_flops_per_token,
    mask_padded_vocab,
    padded_vocab_size,
    register_config,
    registered_types,
)
from .decoder import QkNormAttention
from .deepseek_v3 import DeepseekV3Config, DeepseekV3LMHeadModel
from .gemma import GemmaConfig, GemmaLayout, GemmaLMHeadModel, GemmaRmsNorm
from .gemma2 import Gemma2Config
from .gemma3 import Gemma3Config
from .gpt2 import Gpt2Config, Gpt2LMHeadModel
from .gpt_oss import GptOssConfig, GptOssLMHeadModel
from .llama import LlamaConfig, LlamaLMHeadModel
from .lm import LmExample, LmHeadModel, is_aux_loss
from .lora import LoraConfig, LoraLinear
from .loss import (
    blockwise_cross_entropy_loss,
    compute_next_token_loss,
    compute_next_token_loss_and_aux,
    fused_cross_entropy_loss,
)
from .mistral import MistralConfig, MistralLMHeadModel
from .mixtral import MixtralConfig, MixtralLMHeadModel
from .moe import MOE_DISPATCHES, MoeMlp, RouterOutput, load_balancing_loss, route_top_k, router_metrics
from .olmo2 import Olmo2Config, Olmo2LMHeadModel
from .qwen import QwenConfig, QwenLMHeadModel
from .qwen3 import Qwen3Config, Qwen3LMHeadModel
from .qwen3_moe import Qwen3MoeConfig, Qwen3MoeLMHeadModel
from .remat import CHECKPOINT_NAMES
from .rotary import RotaryConfig, apply_rotary

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_BACKENDS",
    "CHECKPOINT_NAMES",
    "MOE_DISPATCHES",
    "Attention",
    "AttentionMask",
    "DeepseekV3Config",
    "DeepseekV3LMHeadModel",
    "Gemma2Config",
    "Gemma3Config",
    "GemmaConfig",
    "GemmaLMHeadModel",
    "GemmaLayout",
    "GemmaRmsNorm",
    "Gpt2Config",
    "Gpt2LMHeadModel",
    "GptOssConfig",
    "GptOssLMHeadModel",
    "KvCache",
    "LlamaConfig",
    "LlamaLMHeadModel",
    "LmConfig",
    "LmExample",
    "LmHeadModel",
    "LoraConfig",
    "LoraLinear",
    "MistralConfig",
    "MistralLMHeadModel",
    "MixtralConfig",
    "MixtralLMHeadModel",
    "MoeMlp",
    "Olmo2Config",
    "Olmo2LMHeadModel",
    "PagedKvCache",
    "QkNormAttention",
    "Qwen3Config",
    "Qwen3LMHeadModel",
    "Qwen3MoeConfig",
    "Qwen3MoeLMHeadModel",
    "QwenConfig",
    "QwenLMHeadModel",
    "RotaryConfig",
    "RouterOutput",
    "apply_rotary",
    "blockwise_cross_entropy_loss",
    "compute_next_token_loss",
    "compute_next_token_loss_and_aux",
    "config_for_type",
    "dot_product_attention",
    "fused_cross_entropy_loss",
    "is_aux_loss",
    "lm_flops_per_token",
    "load_balancing_loss",
    "mask_padded_vocab",
    "padded_vocab_size",
    "register_config",
    "registered_types",
    "route_top_k",
    "router_metrics",
]
