"""`TransformerConfig`: the model's hyperparameters (config key `model.*`) and their checks.

Plain data, no Flax: the modules of `model` read it, and so do the tools that only count
(`flops`, `memory`, `summary`) or shard (`sharding`) a model.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer.model import lora, quantization
from transformer.ops import attention, layers, linear_attention, moe

# vision: `transformer.model.vit`; classifier: the encoder and a class head (`Transformer.classify`)
ARCHITECTURES = ("encoder_decoder", "encoder", "decoder", "vision", "classifier")
# relative: T5's learned bias per head and relative-position bucket (`ops/relative_position.py`)
POSITIONALS = ("sinusoidal", "learned", "rope", "relative", "none")
NORMS = ("layer_norm", "rms_norm")
# post: Norm(x + Sublayer(x)), the paper's; pre: x + Sublayer(Norm(x)); output: x +
# Norm(Sublayer(x)) (OLMo 2's; pre and output end the stack with a final norm)
NORM_POSITIONS = ("post", "pre", "output")
# model.qk_norm: RMSNorm of the queries and keys before RoPE, over each head's d_k ("head":
# Qwen3, Gemma 3) or over all heads' together, num_heads*d_k ("full": OLMo 2), or none
QK_NORMS = ("none", "head", "full")
POOLINGS = ("cls", "gap")  # a classifier's summary: first (class) token, or mean of the tokens
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_KINDS = ("softmax", "linear")
LAYER_ATTENTION = ("global", "local")  # the entries of model.attention_pattern
# attention.dot_product_attention's, and "splash": the Pallas TPU kernel where it fits
# (ops/splash.py)
ATTENTION_IMPLEMENTATIONS = (*attention.IMPLEMENTATIONS, "splash")
CONTEXT_STRATEGIES = ("all_gather", "ring")  # ops/ring.py's STRATEGIES
VISION_FIELDS = ("image_size", "patch_size", "num_channels", "num_classes", "pooling")
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters. The defaults are the paper's base model (Table 3, first row)."""

    architecture: str = "encoder_decoder"
    vocab_size: int = 37000
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    d_model: int = 512
    d_ff: int = 2048
    num_heads: int = 8
    num_kv_heads: int | None = None  # None: num_heads (multi-head); 1: multi-query
    d_k: int | None = None  # None: d_model // num_heads
    d_v: int | None = None  # None: d_k
    dropout_rate: float = 0.1  # P_drop: residual and embedding dropout
    attention_dropout_rate: float = 0.0
    relu_dropout_rate: float = 0.0
    positional: str = "sinusoidal"
    norm: str = "layer_norm"
    norm_position: str = "post"  # post: LayerNorm(x + Dropout(Sublayer(x))), as the paper
    activation: str = "relu"
    use_bias: bool = True
    qkv_bias: bool = False  # biases on the query, key and value projections alone (Qwen2)
    share_embeddings: bool = True  # source embedding = target embedding
    tie_output_embedding: bool = True  # pre-softmax projection = target embedding
    logits_bias: bool = False  # a bias [V] added to the logits (Marian's final_logits_bias)
    # Gemma 2's: a norm after each sublayer too (post_norm_attention, post_norm_ffn), norms
    # that multiply by scale + norm_scale_offset (Gemma stores scale - 1), attention and
    # output logits capped as c * tanh(logits / c), attention logits scaled by
    # attention_scale_dim^-1/2 instead of d_k^-1/2 (its query_pre_attn_scalar)
    post_sublayer_norm: bool = False
    norm_scale_offset: float = 0.0
    attention_logit_softcap: float | None = None
    logits_softcap: float | None = None
    attention_scale_dim: int | None = None
    qk_norm: str = "none"  # QK_NORMS; scales multiplied by scale + norm_scale_offset too
    # Low-rank adapters (`transformer.model.lora`), set by the run config's `finetune` section:
    # rank (0: none), alpha (scale alpha/rank), dropout, comma-separated target kernels
    lora_rank: int = 0
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    lora_targets: str = "query,value"
    max_len: int = 512
    dtype: str = "float32"  # compute dtype; parameters are always float32
    scan_layers: bool = False
    remat_policy: str = "none"
    attention_implementation: str = "auto"
    norm_eps: float = 1e-6
    # Exactness with published checkpoints (transformer/huggingface): the paper's values first.
    rope_theta: float = 10000.0  # RoPE's base
    # RoPE for a context longer than the one trained on (`layers.rope_inverse_frequencies`):
    # rope_scaling none | linear | llama3 | yarn, its factor, the trained context
    # (llama3, yarn), llama3's wavelength bounds, yarn's rotation bounds and cos/sin scale
    # (None: `layers.yarn_attention_factor`)
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0
    rope_original_max_len: int | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float | None = None
    # The local (windowed) layers' own RoPE base, unscaled (Gemma 3's 10k beside its global
    # layers' 1M); None: the global layers' RoPE
    rope_local_theta: float | None = None
    # positional="relative" (T5): the buckets of the bias table [relative_buckets, N] that the
    # encoder's and the decoder's layers share (each stack its own; the encoder's bidirectional,
    # the decoder's causal), distances from relative_max_distance on sharing the last bucket
    relative_buckets: int = 32
    relative_max_distance: int = 128
    scale_embeddings: bool = True  # token embeddings times sqrt(d_model) (paper section 3.4)
    gelu_approximate: bool = True  # activation="gelu": tanh approximation (False: exact erf)
    # The token ids the model reads (data/tokenizer.py's unless a checkpoint brings its own
    # vocabulary): the decoder's start and a sequence's end, and pad_id 0 (never a target,
    # never generated) or None where id 0 is an ordinary token (GPT-2's "!"): arrays are still
    # padded with 0, and padding is then read from segment ids and lengths alone.
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    pad_id: int | None = PAD_ID
    # Self-attention beyond the paper: "linear" (Katharopoulos et al., 2020; feature map
    # `linear_feature_map`), or softmax over all positions ("global") or a sliding window
    # ("local": the `attention_window` previous positions, and as many after in an encoder),
    # layer by layer as `attention_pattern` (comma-separated, repeated over the layers).
    attention_kind: str = "softmax"
    linear_feature_map: str = "elu"
    attention_window: int | None = None
    attention_pattern: str = "global"  # e.g. "local" (every layer), "local,global" (Gemma 2)
    # Local layers: the first positions of a row attend to and from every position
    # (Longformer's global tokens; the chunked kernel still skips the blocks they do not need).
    attention_global_tokens: int = 0
    # Context parallelism (mesh.context > 1, `transformer.ops.ring`): how self-attention gets
    # the keys and values of the other chips' positions ("all_gather" or "ring"), and whether
    # a decoder's rows are reordered so that every chip has as much causal work
    context_parallel_strategy: str = "all_gather"
    context_load_balance: bool = True
    # Pipeline stages (mesh.stage > 1, `transformer.parallel.pipeline`): the layers' passes
    # through the stages (the circular schedule's repeats) and the microbatches a step's rows
    # are cut into (0: as many as stages). A run config sets them as mesh.pipeline_* (the
    # layout, not the model: a resume may change them).
    pipeline_repeats: int = 1
    pipeline_microbatches: int = 0
    # VISION_FIELDS, read by architecture="vision" (the ViT, `transformer.model.vit`): square
    # images cut into square patches; num_classes and pooling also by "classifier" (text)
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    num_classes: int = 1000
    # cls: the first token's final state (the ViT's class token; a text's first piece);
    # gap: the mean of the final states (the patches; a text's non-padding tokens)
    pooling: str = "cls"
    # Mixture of experts (`transformer.ops.moe`, docs/moe.md): num_experts feed-forward
    # experts (0: dense) in every moe_layer_interval-th layer (layers n-1, 2n-1, ...), each
    # token sent to experts_per_token of them by a float32 router (moe_router_scores, the
    # top-k weights renormalised to sum to 1 where moe_renormalize, as Mixtral); a shared
    # dense expert beside them where moe_shared_expert; moe_capacity_factor 0 dispatches
    # without dropping (ragged_dot), >= 1 gives each expert that many times its even share of
    # slots per row; the load-balancing and router z-loss coefficients
    num_experts: int = 0
    experts_per_token: int = 2
    moe_layer_interval: int = 1
    moe_router_scores: str = "softmax"
    moe_renormalize: bool = True
    moe_shared_expert: bool = False
    moe_capacity_factor: float = 0.0
    moe_aux_loss_coef: float = 0.01
    moe_z_loss_coef: float = 0.001
    # Quantized training matmuls (`transformer.model.quantization`, Qwix): "none", "int8",
    # "int8_full" (the backward's matmuls too) or "fp8", applied to the comma-separated matmul
    # classes (attention, feed_forward, experts)
    quantization: str = "none"
    quantized_matmuls: str = "attention,feed_forward,experts"

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        if self.num_kv_heads is None:
            set_("num_kv_heads", self.num_heads)
        if self.d_k is None:
            if self.num_heads < 1 or self.d_model % self.num_heads:
                raise ValueError(f"model.num_heads={self.num_heads} does not divide "
                                 f"d_model={self.d_model}; change it or set model.d_k")
            set_("d_k", self.d_model // self.num_heads)
        if self.d_v is None:
            set_("d_v", self.d_k)
        quantization.check(self.quantization, self.quantized_matmuls)
        for field, choices in (("architecture", ARCHITECTURES), ("positional", POSITIONALS),
                               ("norm", NORMS), ("norm_position", NORM_POSITIONS),
                               ("activation", layers.ACTIVATIONS),
                               ("remat_policy", tuple(REMAT_POLICIES)), ("dtype", DTYPES),
                               ("pooling", POOLINGS), ("qk_norm", QK_NORMS),
                               ("attention_implementation", ATTENTION_IMPLEMENTATIONS),
                               ("context_parallel_strategy", CONTEXT_STRATEGIES)):
            if getattr(self, field) not in choices:
                raise ValueError(f"model.{field}={getattr(self, field)!r} is not one of "
                                 f"{', '.join(choices)}")
        for field in ("vocab_size", "d_model", "d_ff", "num_heads", "num_kv_heads", "d_k",
                      "d_v", "max_len", "image_size", "patch_size", "num_channels",
                      "num_classes"):
            if getattr(self, field) < 1:
                raise ValueError(f"model.{field}={getattr(self, field)} must be positive")
        if self.pipeline_repeats < 1 or self.pipeline_microbatches < 0:
            raise ValueError(f"mesh.pipeline_repeats={self.pipeline_repeats} must be >= 1 and "
                             f"mesh.pipeline_microbatches={self.pipeline_microbatches} >= 1 "
                             f"(0: as many as mesh.stage)")
        for field in ("dropout_rate", "attention_dropout_rate", "relu_dropout_rate"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise ValueError(f"model.{field}={getattr(self, field)} must be in [0, 1)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads={self.num_kv_heads} does not divide "
                             f"num_heads={self.num_heads}")
        if self.pad_id not in (PAD_ID, None):
            raise ValueError(f"model.pad_id={self.pad_id} must be {PAD_ID} (padding) or None (no "
                             f"padding token: id {PAD_ID} is an ordinary token)")
        if self.pad_id is None and self.attention_kind != "softmax":
            raise ValueError("model.pad_id=None needs softmax attention: linear layers read "
                             "padding from id 0 while decoding")
        for field in ("bos_id", "eos_id") if self.num_decoder_layers else ():
            if not 0 <= getattr(self, field) < self.vocab_size:
                raise ValueError(f"model.{field}={getattr(self, field)} is not an id of the "
                                 f"vocabulary (0 to vocab_size-1={self.vocab_size - 1})")
        for field in ("rope_theta", "rope_local_theta"):
            if getattr(self, field) is not None and getattr(self, field) <= 0:
                raise ValueError(f"model.{field}={getattr(self, field)} must be positive")
        self._check_rope_scaling()
        if self.rope_local_theta is not None and (
                self.positional != "rope" or "local" not in self.attention_pattern.split(",")):
            raise ValueError(f"model.rope_local_theta={self.rope_local_theta} is the RoPE base "
                             f"of local layers: set positional='rope' and a local "
                             f"attention_pattern, or unset it")
        for field in ("attention_logit_softcap", "logits_softcap", "attention_scale_dim"):
            if getattr(self, field) is not None and getattr(self, field) <= 0:
                raise ValueError(f"model.{field}={getattr(self, field)} must be positive "
                                 f"(or None: off)")
        if self.attention_logit_softcap is not None and self.attention_implementation not in (
                "xla", "auto"):
            raise ValueError(f"model.attention_logit_softcap needs attention_implementation "
                             f"'xla' or 'auto', got {self.attention_implementation!r}")
        if self.positional == "rope" and self.d_k % 2:
            raise ValueError(f"model.positional='rope' needs an even d_k, got {self.d_k}")
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"model.positional='sinusoidal' needs an even d_model, "
                             f"got {self.d_model}")
        if self.positional == "relative":
            self._check_relative()
        if self.architecture == "encoder_decoder" and min(self.num_encoder_layers,
                                                         self.num_decoder_layers) < 1:
            raise ValueError("model.num_encoder_layers and num_decoder_layers must be >= 1")
        self._check_attention_pattern()
        lora.check(self)
        if self.num_experts:
            self._check_experts()
        if self.architecture == "vision":
            self._check_vision()

    def _check_rope_scaling(self):
        if self.rope_scaling not in layers.ROPE_SCALINGS:
            raise ValueError(f"model.rope_scaling={self.rope_scaling!r} is not one of "
                             f"{', '.join(layers.ROPE_SCALINGS)}")
        if self.rope_scaling_factor <= 0:
            raise ValueError(f"model.rope_scaling_factor={self.rope_scaling_factor} must be "
                             f"positive")
        if self.rope_scaling in ("llama3", "yarn") and not self.rope_original_max_len:
            raise ValueError(f"model.rope_scaling={self.rope_scaling!r} needs "
                             f"model.rope_original_max_len (the context trained on, e.g. 8192)")
        if self.rope_scaling == "llama3" and not (
                0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            raise ValueError(f"model.rope_low_freq_factor={self.rope_low_freq_factor} and "
                             f"rope_high_freq_factor={self.rope_high_freq_factor} must be "
                             f"0 < low < high (Llama 3.1: 1 and 4)")

    def _check_relative(self):
        if self.relative_buckets < 4 or not (self.relative_buckets // 2
                                             < self.relative_max_distance):
            raise ValueError(f"model.relative_buckets={self.relative_buckets} and "
                             f"relative_max_distance={self.relative_max_distance} must be >= 4 "
                             f"and > relative_buckets / 2 (T5: 32 and 128)")
        if self.attention_kind != "softmax" or self.attention_window is not None:
            raise ValueError("model.positional='relative' biases softmax attention over all "
                             "positions: set attention_kind='softmax' and no attention_window")

    @property
    def attention_scale(self) -> float | None:
        """The logits' scale where it is not 1/sqrt(d_k) (`attention_scale_dim`), else None."""
        return None if self.attention_scale_dim is None else self.attention_scale_dim ** -0.5

    def rope_arguments(self, local: bool = False) -> dict:
        """`layers.apply_rope`'s `inv_freq` and `scale` for this model's RoPE, or for its
        local layers' where `local` and `rope_local_theta` is set."""
        if local and self.rope_local_theta is not None:
            return dict(base=self.rope_local_theta)
        if self.rope_scaling == "none":
            return dict(base=self.rope_theta)
        inv_freq = layers.rope_inverse_frequencies(
            self.d_k, base=self.rope_theta, scaling=self.rope_scaling,
            factor=self.rope_scaling_factor, original_max_len=self.rope_original_max_len,
            low_freq_factor=self.rope_low_freq_factor,
            high_freq_factor=self.rope_high_freq_factor, beta_fast=self.rope_beta_fast,
            beta_slow=self.rope_beta_slow)
        scale = 1.0
        if self.rope_scaling == "yarn":
            scale = (layers.yarn_attention_factor(self.rope_scaling_factor)
                     if self.rope_attention_factor is None else self.rope_attention_factor)
        return dict(inv_freq=inv_freq, scale=scale)

    def _check_attention_pattern(self):
        for field, choices in (("attention_kind", ATTENTION_KINDS),
                               ("linear_feature_map", tuple(linear_attention.FEATURE_MAPS))):
            if getattr(self, field) not in choices:
                raise ValueError(f"model.{field}={getattr(self, field)!r} is not one of "
                                 f"{', '.join(choices)}")
        pattern = self.attention_pattern.split(",")
        if any(entry not in LAYER_ATTENTION for entry in pattern):
            raise ValueError(f"model.attention_pattern={self.attention_pattern!r}: each "
                             f"comma-separated entry must be global or local (e.g. "
                             f"'local,global')")
        if self.attention_window is not None and self.attention_window < 1:
            raise ValueError(f"model.attention_window={self.attention_window} must be >= 1 "
                             f"(or None: no local layers)")
        if "local" in pattern and self.attention_window is None:
            raise ValueError(f"model.attention_pattern={self.attention_pattern!r} has local "
                             f"layers: set model.attention_window (e.g. 256)")
        if self.attention_window is not None and "local" not in pattern:
            raise ValueError(f"model.attention_window={self.attention_window} has no effect with "
                             f"attention_pattern='global': set attention_pattern='local' (every "
                             f"layer) or e.g. 'local,global'")
        if self.attention_global_tokens < 0 or (self.attention_global_tokens
                                                and "local" not in pattern):
            raise ValueError(f"model.attention_global_tokens={self.attention_global_tokens} "
                             f"must be >= 0 and widens local windows: set 0, or "
                             f"model.attention_window with a local attention_pattern")
        if self.attention_kind == "linear" and self.attention_window is not None:
            raise ValueError("model.attention_kind='linear' attends to every position: unset "
                             "model.attention_window and attention_pattern")
        layers_ = max(self.num_encoder_layers, self.num_decoder_layers)
        if self.scan_layers and len({self.layer_window(i) for i in range(layers_)}) > 1:
            raise ValueError(f"model.attention_pattern={self.attention_pattern!r} differs "
                             f"between layers, which model.scan_layers=True cannot stack (their "
                             f"decoding caches differ): set scan_layers=False or a uniform "
                             f"pattern")

    def _check_experts(self):
        if self.num_experts < 0 or not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"model.experts_per_token={self.experts_per_token} must be in 1.."
                             f"model.num_experts={self.num_experts}")
        if self.moe_router_scores not in moe.ROUTER_SCORES:
            raise ValueError(f"model.moe_router_scores={self.moe_router_scores!r} is not one of "
                             f"{', '.join(moe.ROUTER_SCORES)}")
        if self.moe_layer_interval < 1:
            raise ValueError(f"model.moe_layer_interval={self.moe_layer_interval} must be >= 1")
        if 0 < self.moe_capacity_factor < 1 or self.moe_capacity_factor < 0:
            raise ValueError(f"model.moe_capacity_factor={self.moe_capacity_factor} drops tokens "
                             f"even from a balanced router: set 0 (dropless dispatch) or >= 1")
        if self.scan_layers and self.moe_layer_interval > 1:
            raise ValueError(f"model.moe_layer_interval={self.moe_layer_interval} makes layers "
                             f"differ, which model.scan_layers=True cannot stack: set "
                             f"scan_layers=False or moe_layer_interval=1")
        if self.architecture in ("vision", "classifier"):
            raise ValueError(f"model.num_experts={self.num_experts}: experts are for the "
                             f"encoder-decoder, encoder and decoder architectures")

    def routed(self, layer: int) -> bool:
        """Whether layer `layer` (same index in the encoder and the decoder) has experts."""
        return self.num_experts > 0 and (layer + 1) % self.moe_layer_interval == 0

    def layer_window(self, layer: int) -> int | None:
        """The window w of layer `layer`'s self-attention (same index in the encoder and the
        decoder), or None for a layer that attends to every position."""
        pattern = self.attention_pattern.split(",")
        return self.attention_window if pattern[layer % len(pattern)] == "local" else None

    def _check_vision(self):
        if self.image_size % self.patch_size:
            raise ValueError(f"model.patch_size={self.patch_size} does not divide "
                             f"image_size={self.image_size}")
        if self.positional not in ("learned", "none"):
            raise ValueError(f"model.positional={self.positional!r}: the vision model takes "
                             f"'learned' (the ViT's) or 'none'")
        if self.num_encoder_layers < 1:
            raise ValueError("model.num_encoder_layers must be >= 1")

    @property
    def num_patches(self) -> int:
        """Patches of one image (the vision model): (image_size / patch_size)^2."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def classifies(self) -> bool:
        """One row of class logits per example (the ViT, the text classifier), not per token."""
        return self.architecture in ("vision", "classifier")

    @property
    def dense_attention_implementation(self) -> str:
        """What `attention.dot_product_attention` runs: the configured implementation, "auto"
        for "splash" (where the kernel does not fit, `blocks.MultiHeadAttention`)."""
        return "auto" if self.attention_implementation == "splash" else (
            self.attention_implementation)

    @property
    def context_load_balanced(self) -> bool:
        """Whether a decoder's training rows go through its layers in `ops/ring.py`'s
        load-balanced order where the mesh splits the positions over "context":
        `context_load_balance` with softmax attention (linear attention's running sums read the
        row in order)."""
        return self.context_load_balance and self.attention_kind == "softmax"

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @classmethod
    def from_dict(cls, values) -> TransformerConfig:
        """From a mapping such as `config.model`. Unknown keys are an error naming them."""
        values = dict(values)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; known: {sorted(known)}")
        return cls(**values)
