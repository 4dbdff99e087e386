"""EagleHead: fc on [embed(next token); target feature], one Llama decoder layer, shared LM head.

docs/spec.md §1: `fc = Linear(2h -> h)` on `concat(embed(token_{t+1}), feature_t)`, then one decoder
layer with NO input layernorm and NO final norm; the target's own embedding and LM head are
used by reference (they are never copied, registered or saved). Module and key names follow
the published EAGLE / HASS heads: `fc.*`, `layers.0.*`.

Draft vocabulary (EAGLE-3 / SGLang): a head may draft over N target tokens only, `draft_ids`
[N] (their target ids, ascending). Its logits are then the N matching rows of the target's LM
head, so drafting and training pay an [.., N] matmul instead of [.., V]. Those rows are sliced
once per bind (and again only if the LM head's weight moves to another device or dtype), never
per call, and kept out of state_dict: the checkpoint stores the mapping as d2t / t2d
(drafter/checkpoint.py). Verification never sees draft indices: expand.py maps them to target ids.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from taps.core import packed

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


class DraftHead(nn.Module):
    """What every draft head shares (EAGLE-2 / HASS `EagleHead`, EAGLE-3 `Eagle3Head` in
    drafter/head3.py): the target's embedding (and LM head) used by reference, an optional draft
    vocabulary, and which of the target's hidden states it reads. The decoder, tree expansion,
    compositions and training talk to this interface only, so a backbone is a subclass.

    Features: a Target returns, per position, the concatenation of the hidden-state layers it
    captures (`Target.feature_layers`, the last layer always first). A head names the layers it
    needs (`feature_layers`, Hugging Face `hidden_states` indices); `attach(target)` asks the
    target to capture them and remembers where their columns lie, and `select_features` takes
    them out of the target's output.
    """

    config: LlamaConfig

    def _init_shared(self) -> None:
        self._shared: tuple[nn.Module, nn.Module] | None = None
        # [N] long target id of each draft index, or None (the full vocabulary); not in state_dict
        self.register_buffer("draft_ids", None, persistent=False)
        self._draft_rows: tuple[tuple, nn.Linear] | None = None  # (key, the rows [N, H] as a linear layer)
        self._columns: slice | Tensor | None = None  # this head's columns of the target's features ([k * H] long)

    # ---- the target --------------------------------------------------------------------------
    feature_layers: tuple[int, ...] = (-1,)  # hidden_states indices this head reads; -1: the last layer

    def bind(self, embed_tokens: nn.Module, lm_head: nn.Module) -> "DraftHead":
        """Use the target's embedding and LM head by reference (a plain tuple: not submodules,
        so they never appear in parameters(), state_dict() or an optimizer)."""
        self._shared = (embed_tokens, lm_head)
        self._draft_rows = None
        return self

    def attach(self, target) -> "DraftHead":
        """Bind to a taps Target and make it capture the hidden states this head reads."""
        self.bind(target.embed_tokens, target.lm_head)
        columns = target.capture(self.feature_layers)  # [k * H] long
        start = int(columns[0])
        contiguous = bool((columns == torch.arange(start, start + columns.numel())).all())
        self._columns = slice(start, start + columns.numel()) if contiguous else columns
        return self

    def share_target(self, other: "DraftHead") -> "DraftHead":
        """Use the same target as `other` (its embedding, LM head and feature columns)."""
        self.bind(*other.shared)
        self._columns = other._columns
        return self

    def select_features(self, features: Tensor) -> Tensor:  # [..., F] target output -> [..., k * H]
        """This head's layers out of the target's features (the first H columns, the last layer,
        when the head was only bound, not attached)."""
        h = int(self.config.hidden_size)
        if self._columns is None:
            return features[..., :h]  # a view: the last layer comes first
        if isinstance(self._columns, slice):
            return features[..., self._columns]  # a view: the usual case (the layers were captured in order)
        return features.index_select(-1, self._columns.to(features.device))

    @property
    def is_bound(self) -> bool:
        return self._shared is not None

    @property
    def shared(self) -> tuple[nn.Module, nn.Module]:
        """The target's (embedding, LM head) this head uses."""
        if self._shared is None:
            raise RuntimeError(f"{type(self).__name__} is not bound to a target: call head.bind(embed_tokens, lm_head)")
        return self._shared

    # ---- the draft vocabulary ------------------------------------------------------------------
    def _check_draft_ids(self, draft_ids: Tensor | None) -> Tensor | None:
        if draft_ids is None:
            return None
        ids = torch.as_tensor(draft_ids).detach()
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"draft_ids must be a non-empty 1-D integer tensor, got {ids.dtype} "
                             f"{tuple(ids.shape)}")
        ids = ids.long().cpu().clone()  # our own copy: the caller's tensor may change
        v = self.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= v:
            raise ValueError(f"draft_ids must lie in [0, {v}), got {int(ids.min())}..{int(ids.max())}")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("draft_ids must be distinct and sorted ascending")
        return ids.to(self.fc.weight.device)

    def set_draft_vocab(self, draft_ids: Tensor | None) -> "DraftHead":
        """Draft over these target ids only ([N], distinct, ascending, within the LM head's
        vocab_size), or over the full vocabulary (None)."""
        self.draft_ids = self._check_draft_ids(draft_ids)
        self._draft_rows = None
        return self

    @property
    def draft_vocab_size(self) -> int:
        """N with a draft vocabulary, else the target's vocabulary size."""
        return int(self.draft_ids.numel()) if self.draft_ids is not None else int(self.config.vocab_size)

    def to_target_ids(self, index: Tensor) -> Tensor:  # [...] draft index -> [...] target id
        """Target token ids of draft indices (the identity without a draft vocabulary)."""
        return index if self.draft_ids is None else self.draft_ids[index]

    def target_logits(self, hidden: Tensor) -> Tensor:  # [..., H] target feature -> [..., V] or [..., N]
        """The TARGET's LM head over the draft vocabulary: its next-token logits at a true last-layer
        feature, the teacher of every training loss (for an EAGLE-2 head also its own logits)."""
        _, lm_head = self.shared
        if self.draft_ids is None:
            return lm_head(hidden)
        return self._draft_lm_head(lm_head)(hidden)  # [..., N]

    def _draft_lm_head(self, lm_head: nn.Module) -> nn.Linear:
        """The LM head's rows of the draft vocabulary as a linear layer ([N, H], bias [N] or None;
        packed on a CPU: taps.core.packed), sliced on first use after a bind and again only if the
        LM head's weight changed device, dtype or storage. Sliced outside inference mode (a tensor
        made inside it could not be saved for backward in a later training step) and without grad:
        the LM head is the target's, frozen."""
        weight = lm_head.weight
        key = (weight.device, weight.dtype, weight.data_ptr(), self.draft_ids.device, self.draft_ids.data_ptr())
        if self._draft_rows is None or self._draft_rows[0] != key:
            bias = getattr(lm_head, "bias", None)
            with torch.inference_mode(False), torch.no_grad():
                ids = self.draft_ids.to(weight.device)
                rows = weight.index_select(0, ids)  # [N, H]
                rows_bias = bias.index_select(0, ids) if bias is not None else None  # [N]
                layer = packed.linear_of(rows, rows_bias)
            self._draft_rows = (key, layer)
        return self._draft_rows[1]


class EagleHead(DraftHead):
    """The EAGLE-2 / HASS head (module docstring)."""

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
        self._init_shared()

    def forward(
        self,
        tokens: Tensor,  # [B, T] long: token t+1 for each position t
        features: Tensor,  # [B, T, H] target (or predicted) feature at position t
        position_ids: Tensor,  # [B, T] long
        attention_mask: Tensor,  # [B, 1, T, past + T] additive
        cache=None,  # the head's own DynamicCache, or None (training)
        **attention_kwargs,  # handed to the attention function untouched (training's band rows)
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
            **attention_kwargs,
        )

    def logits(self, hidden: Tensor) -> Tensor:  # [..., H] -> [..., V], or [..., N] with a draft vocabulary
        """The head's draft logits: the target's own LM head (rows of the draft vocabulary)."""
        return self.target_logits(hidden)
