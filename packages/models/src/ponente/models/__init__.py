"""A zoo of foundation models written with ``ponente.namedtensor``, with Hugging Face import/export."""

from .attention import Attention, AttentionMask, dot_product_attention
from .config import LmConfig, config_for_type, lm_flops_per_token, register_config, registered_types
from .gpt2 import Gpt2Config, Gpt2LMHeadModel
from .llama import LlamaConfig, LlamaLMHeadModel
from .lm import LmExample, LmHeadModel
from .loss import compute_next_token_loss
from .rotary import RotaryConfig, apply_rotary

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "AttentionMask",
    "Gpt2Config",
    "Gpt2LMHeadModel",
    "LlamaConfig",
    "LlamaLMHeadModel",
    "LmConfig",
    "LmExample",
    "LmHeadModel",
    "RotaryConfig",
    "apply_rotary",
    "compute_next_token_loss",
    "config_for_type",
    "dot_product_attention",
    "lm_flops_per_token",
    "register_config",
    "registered_types",
]

# --- M1 exports ---
# ``attention.attention`` is not re-exported here: the function would shadow the subpackage
# (``ponente.models.attention`` would stop being a package); import it, and ``attention.flash.flash_attention``, from
# the subpackage.
from .attention import ATTENTION_BACKENDS
from .loss import blockwise_cross_entropy_loss, fused_cross_entropy_loss

__all__ += ["ATTENTION_BACKENDS", "blockwise_cross_entropy_loss", "fused_cross_entropy_loss"]
# --- end M1 exports ---

# --- M2 exports ---
from .config import mask_padded_vocab, padded_vocab_size  # noqa: E402
from .llama import QkNormAttention  # noqa: E402

__all__ += ["QkNormAttention", "mask_padded_vocab", "padded_vocab_size"]
# --- end M2 exports ---

# --- Z1 exports ---
from .mistral import MistralConfig, MistralLMHeadModel  # noqa: E402
from .qwen import QwenConfig, QwenLMHeadModel  # noqa: E402
from .qwen3 import Qwen3Config, Qwen3LMHeadModel  # noqa: E402

__all__ += ["MistralConfig", "MistralLMHeadModel", "Qwen3Config", "Qwen3LMHeadModel", "QwenConfig", "QwenLMHeadModel"]
# --- end Z1 exports ---

# --- Z2 exports ---
from .gemma import GemmaConfig, GemmaLayout, GemmaLMHeadModel, GemmaRmsNorm  # noqa: E402
from .gemma2 import Gemma2Config  # noqa: E402
from .gemma3 import Gemma3Config  # noqa: E402

__all__ += ["Gemma2Config", "Gemma3Config", "GemmaConfig", "GemmaLMHeadModel", "GemmaLayout", "GemmaRmsNorm"]
# --- end Z2 exports ---

# --- Z3 exports ---
from .loss import compute_next_token_loss_and_aux  # noqa: E402
from .mixtral import MixtralConfig, MixtralLMHeadModel  # noqa: E402
from .moe import MOE_DISPATCHES, MoeMlp, RouterOutput, load_balancing_loss, route_top_k  # noqa: E402
from .olmo2 import Olmo2Config, Olmo2LMHeadModel  # noqa: E402

__all__ += [
    "MOE_DISPATCHES",
    "MixtralConfig",
    "MixtralLMHeadModel",
    "MoeMlp",
    "Olmo2Config",
    "Olmo2LMHeadModel",
    "RouterOutput",
    "compute_next_token_loss_and_aux",
    "load_balancing_loss",
    "route_top_k",
]
# --- end Z3 exports ---

# --- H2 (LoRA) exports ---
from .lora import LoraConfig, LoraLinear  # noqa: E402

__all__ += ["LoraConfig", "LoraLinear"]
# --- end H2 exports ---

# --- G1a (KV cache) exports ---
from .attention import KvCache  # noqa: E402

__all__ += ["KvCache"]
# --- end G1a exports ---

# --- P1 exports ---
from .remat import CHECKPOINT_NAMES  # noqa: E402

__all__ += ["CHECKPOINT_NAMES"]
# --- end P1 exports ---
