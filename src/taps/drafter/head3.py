"""Eagle3Head: the EAGLE-3 draft head (Li et al., 2025, "Training-Time Test"), in the layout the
engines read (SGLang's and vLLM's `LlamaForCausalLMEagle3`, SpecForge's checkpoints).

What differs from the EAGLE-2 head (drafter/head.py), and why:
- It reads three of the target's hidden states, a low, a middle and a high layer, not only the
  last one: the last layer is shaped for the target's own next token, the lower ones still
  carry what later tokens need. `fc` (3H -> H, no bias) fuses them into one H-wide feature.
  Which layers is `eagle_aux_hidden_state_layer_ids` in config.json, the key SGLang, vLLM and
  llama.cpp's converter read: layer L means the OUTPUT of decoder layer L (0-based), i.e. Hugging
  Face `hidden_states[L + 1]`. The default [1, N//2 - 1, N - 4] is what the engines capture when
  the key is absent (the inputs of layers 2, N//2 and N - 3).
- Its one decoder layer (`midlayer`) attends over [input_layernorm(embed(token)); hidden_norm(x)],
  2H wide (q/k/v take 2H), with x as the residual stream; then the usual MLP block.
- It has its own final `norm` and its own `lm_head` over a reduced draft vocabulary of N tokens
  (`d2t` / `t2d`, as drafter/checkpoint.py writes them); only the embedding is the target's.
- Drafting deeper than one level feeds the head its own pre-norm output (H wide) in place of a
  fused feature: `forward` fuses only inputs 3H wide, exactly as the engines do.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from taps.drafter.head import DraftHead, head_config_for

ARCHITECTURE = "LlamaForCausalLMEagle3"
AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high layer (outputs, 0-based) the engines capture without a config key."""
    layers = (1, num_layers // 2 - 1, num_layers - 4)
    if len(set(layers)) < 3 or min(layers) < 0:
        raise ValueError(f"the default EAGLE-3 layers {list(layers)} of a {num_layers}-layer target are not three "
                         "distinct layers; name them (aux_layers)")
    return layers


def check_aux_layers(layers, num_layers: int, where: str) -> tuple[int, ...]:
    """At least two distinct decoder-layer indices in [0, num_layers - 1) (three for SGLang and
    llama.cpp; vLLM sizes fc by the count): the last layer's output is not a hidden state the
    engines capture (the final norm follows it), and `forward` tells a target input (k x H) from
    the head's own output (H) by its width, which one layer would make ambiguous."""
    if (not isinstance(layers, (list, tuple)) or len(layers) < 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)):
        raise ValueError(f"{where}: {AUX_LAYERS_KEY} must be a list of layer indices (at least two), got {layers!r}")
    if len(set(layers)) != len(layers) or min(layers) < 0 or max(layers) >= num_layers - 1:
        raise ValueError(f"{where}: {AUX_LAYERS_KEY} {list(layers)} must be distinct layer indices in "
                         f"[0, {num_layers - 1}) for a target of {num_layers} layers")
    return tuple(int(x) for x in layers)


def eagle3_config_for(target_config, draft_vocab_size: int | None = None, aux_layers=None,
                      attn_implementation: str = "sdpa") -> LlamaConfig:
    """A one-layer EAGLE-3 config sized for a target: its hidden size, heads and rope, a draft
    vocabulary of N tokens (None: all of them) and the target layers it reads (None: the default)."""
    config = head_config_for(target_config, attn_implementation)
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    layers = int(text.num_hidden_layers)
    aux = check_aux_layers(list(aux_layers), layers, "aux_layers") if aux_layers is not None else default_aux_layers(layers)
    config.architectures = [ARCHITECTURE]
    config.draft_vocab_size = int(draft_vocab_size or config.vocab_size)
    config.target_hidden_size = int(text.hidden_size)
    setattr(config, AUX_LAYERS_KEY, list(aux))
    return config


class Eagle3Layer(nn.Module):
    """The midlayer: a Llama decoder layer whose attention reads [embeds; feature] (2H)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        attn = self.self_attn
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        attn.q_proj = nn.Linear(2 * h, heads * attn.head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * h, kv_heads * attn.head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * h, kv_heads * attn.head_dim, bias=False)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, embeds: Tensor, hidden: Tensor, attention_mask: Tensor, position_ids: Tensor, cache,
                position_embeddings, **attention_kwargs) -> Tensor:  # [B, T, H] x2 -> [B, T, H]
        both = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        attended, _ = self.self_attn(hidden_states=both, attention_mask=attention_mask, position_ids=position_ids,
                                     cache=cache, use_cache=cache is not None,
                                     position_embeddings=position_embeddings, **attention_kwargs)
        hidden = hidden + attended  # the residual stream is the feature, not the embedding
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(DraftHead):
    """config: a one-layer LlamaConfig plus `draft_vocab_size` (N), `target_hidden_size` and
    `eagle_aux_hidden_state_layer_ids` (module docstring); `target_layers`: the target's depth."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.bias = False
        target_h = int(getattr(config, "target_hidden_size", None) or h)
        self.aux_layers = tuple(getattr(config, AUX_LAYERS_KEY))
        n = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.fc = nn.Linear(len(self.aux_layers) * target_h, h, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, n, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)  # buffers only, not persistent
        self._init_shared()

    @property
    def feature_layers(self) -> tuple[int, ...]:  # Hugging Face hidden_states indices
        return tuple(layer + 1 for layer in self.aux_layers)

    def set_draft_vocab(self, draft_ids: Tensor | None) -> "Eagle3Head":
        """The ids of the lm_head's N rows; None only when N is the whole vocabulary."""
        n = self.lm_head.weight.shape[0]
        if draft_ids is None and n != self.config.vocab_size:
            raise ValueError(f"this EAGLE-3 head drafts over {n} tokens: its draft ids (d2t) are needed")
        if draft_ids is not None and torch.as_tensor(draft_ids).numel() != n:
            raise ValueError(f"{torch.as_tensor(draft_ids).numel()} draft ids for an lm_head of {n} rows")
        return super().set_draft_vocab(draft_ids)

    @torch.no_grad()
    def init_from_target(self, target) -> "Eagle3Head":
        """Start the head's own `norm` and `lm_head` from the target's final norm and the LM head's
        rows of the draft vocabulary (bind and set the draft vocabulary first). The head's output
        then begins in the target's last-layer space, where the EAGLE-2 head lives for good: on
        little data (a CPU-sized family) a randomly initialised LM head of N x H weights is what
        holds EAGLE-3 back. Training moves both freely; inference never depends on this."""
        norm = getattr(getattr(target.model, "model", None), "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(norm.weight.to(self.norm.weight))
        rows = target.lm_head.weight if self.draft_ids is None else target.lm_head.weight.index_select(
            0, self.draft_ids.to(target.lm_head.weight.device))  # [N, H]
        self.lm_head.weight.copy_(rows.to(self.lm_head.weight))
        return self

    def fuse(self, features: Tensor) -> Tensor:  # [..., 3H] target layers -> [..., H]
        return self.fc(features)

    def forward(
        self,
        tokens: Tensor,  # [B, T] long: token t+1 for each position t
        features: Tensor,  # [B, T, 3H] the target's layers at position t, or [B, T, H] fused / own output
        position_ids: Tensor,  # [B, T] long
        attention_mask: Tensor,  # [B, 1, T, past + T] additive
        cache=None,  # the head's own DynamicCache, or None (training)
        **attention_kwargs,  # handed to the attention function untouched (training's band rows)
    ) -> Tensor:  # [B, T, H] pre-norm output: the next level's input feature
        embed, _ = self.shared
        hidden = features if features.shape[-1] == self.config.hidden_size else self.fuse(features)
        cos_sin = self.rotary_emb(hidden, position_ids)
        return self.midlayer(embed(tokens).to(hidden.dtype), hidden, attention_mask, position_ids, cache, cos_sin,
                             **attention_kwargs)

    def logits(self, hidden: Tensor) -> Tensor:  # [..., H] -> [..., N]
        return self.lm_head(self.norm(hidden))

    def select_features(self, features: Tensor) -> Tensor:  # [..., F] target output -> [..., 3H]
        if self._columns is None:
            raise RuntimeError("an EAGLE-3 head reads the target's middle layers: call head.attach(target) (the "
                               "target then captures them) before decoding")
        return super().select_features(features)
