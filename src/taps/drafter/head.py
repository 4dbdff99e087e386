"""EagleHead: fc on [embed(next token); target feature], one Llama decoder layer, shared LM head.

SPEC §1: `fc = Linear(2h -> h)` on `concat(embed(token_{t+1}), feature_t)`, then one decoder
layer with NO input layernorm and NO final norm; the target's own embedding and LM head are
used by reference (they are never copied, registered or saved). Module and key names follow
the published EAGLE / HASS heads: `fc.*`, `layers.0.*`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

# The head only ever receives explicit additive masks; flash kernels would ignore them.
HEAD_ATTENTION = {"eager": "eager", "sdpa": "sdpa"}


def head_config_for(target_config, attn_implementation: str = "sdpa") -> LlamaConfig:
    """A one-layer LlamaConfig sized for a target (Llama, Qwen2, Mistral, ... text config)."""
    cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
        rope_parameters=dict(cfg.rope_parameters) if getattr(cfg, "rope_parameters", None) else None,
        hidden_act=getattr(cfg, "hidden_act", "silu"),
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLMEagle"],
    )
    config._attn_implementation = HEAD_ATTENTION.get(attn_implementation, "sdpa")
    return config


class EagleHead(nn.Module):
    def __init__(self, config: LlamaConfig, bias: bool = False):
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.bias = bias
        self.fc = nn.Linear(2 * h, h, bias=bias)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        layer.input_layernorm = nn.Identity()  # EAGLE: no norm on the layer's input
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = LlamaRotaryEmbedding(config)  # buffers only, not persistent
        self._shared: tuple[nn.Module, nn.Module] | None = None

    def bind(self, embed_tokens: nn.Module, lm_head: nn.Module) -> "EagleHead":
        """Use the target's embedding and LM head by reference (a plain tuple: not submodules,
        so they never appear in parameters(), state_dict() or an optimizer)."""
        self._shared = (embed_tokens, lm_head)
        return self

    @property
    def is_bound(self) -> bool:
        return self._shared is not None

    @property
    def shared(self) -> tuple[nn.Module, nn.Module]:
        """The target's (embedding, LM head) this head uses."""
        if self._shared is None:
            raise RuntimeError("EagleHead is not bound to a target: call head.bind(embed_tokens, lm_head)")
        return self._shared

    def forward(
        self,
        tokens: Tensor,  # [B, T] long: token t+1 for each position t
        features: Tensor,  # [B, T, H] target (or predicted) feature at position t
        position_ids: Tensor,  # [B, T] long
        attention_mask: Tensor,  # [B, 1, T, past + T] additive
        cache=None,  # the head's own DynamicCache, or None (training)
    ) -> Tensor:  # [B, T, H] predicted feature for position t + 1
        embed, _ = self.shared
        x = self.fc(torch.cat([embed(tokens).to(features.dtype), features], dim=-1))  # [B, T, H]
        cos_sin = self.rotary_emb(x, position_ids)
        return self.layers[0](
            x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=cos_sin,
        )

    def logits(self, hidden: Tensor) -> Tensor:  # [..., H] -> [..., V]
        _, lm_head = self.shared
        return lm_head(hidden)
