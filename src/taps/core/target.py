"""Target: an UNMODIFIED Hugging Face causal LM plus its tokenizer, driven through its cache.

A tree forward is the library's own forward with explicit position_ids (prefix length + node
depth) and the tree's ancestor structure, which taps.core.attention (an AttentionInterface function
the Target selects) applies as an N x N mask on the tree block only; a model whose attention it
does not wrap gets the additive 4D mask [1, 1, N, prefix + N] instead. The KV cache is the
library's DynamicCache, pruned by kv.py. One code path therefore serves Llama, Qwen2, Mistral and
any other architecture whose forward accepts a prepared 4D mask.

Invariant between calls: the cache holds every token of the sequence except the last one,
which is pending (it is the root of the next draft tree, or the next plain-decoding input).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from taps.core import attention, kv, machine, packed
from taps.core.config import DEVICE_PATTERN
from taps.core.identity import tensors_identity, weights_identity
from taps.core.targets import resolve_target, target_name
from taps.core.tree import DraftTree, additive_mask

# End-of-turn markers of common chat templates; used as stop tokens when the tokenizer has them.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")


LAST_LAYER = -1  # Hugging Face hidden_states index of the last layer (after the final norm: the LM head's input)


@dataclass(frozen=True)
class TargetOut:
    logits: Tensor  # [T, V] (prefill: [1, V], the last position only, unless all_logits=True)
    features: Tensor  # [T, k * H] the captured hidden states (Target.feature_layers), the last layer first


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    if not re.fullmatch(DEVICE_PATTERN, device):
        raise ValueError(f"--device {device}: expected auto, cpu, cuda, cuda:N or mps")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device} was asked for, but no CUDA device is available")
    return torch.device(device)


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device, measure_on: tuple[Path, str, bool] | None = None) -> torch.dtype:
    """"auto": bf16 on GPUs that support it (else fp16); on a CPU the faster of bf16 and float32
    for a verify step of this target, measured once and cached (taps.core.machine; `measure_on`: the
    model directory, the target's name, trust_remote_code), float32 when there is nothing to
    measure. Greedy speculative output is token-identical to plain decoding only in float32: in
    bf16 a tree forward and a one-token forward round differently, so the target's near-ties can flip."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "cpu" and measure_on is not None:
            return machine.cpu_dtype(*measure_on)
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary (token -> id), so a head trained for one tokenizer is never
    silently served with another."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv_: kv_[1])
    blob = json.dumps(vocab, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:32]


class Target:
    """The verifier. Owns one KV cache (batch size 1) and nothing else."""

    def __init__(self, model, tokenizer=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config.get_text_config()
        self.cache = kv.new_cache()
        self._tree_start: int | None = None
        # hidden_states indices whose rows every forward returns, concatenated: the last layer, then
        # whatever the attached heads read (an EAGLE-3 head's low / middle / high layers)
        self.feature_layers: tuple[int, ...] = (LAST_LAYER,)
        # tree forwards through taps.core.attention (False: the dense-mask path, logged once)
        self.tree_attention = attention.enable(self.model)
        # on a CPU, linear weights packed once for oneDNN (taps.core.packed): same outputs, faster steps
        self.packed_linears = packed.pack_linears(self.model)
        self.name = str(getattr(self.config, "_name_or_path", "") or "target")  # Target.load sets a short name
        self.source_dir: Path | None = None  # the model directory Target.load read (a GGUF's cached conversion)
        self._weights: str | None = None

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        attn_implementation: str = "sdpa",
        trust_remote_code: bool = False,
    ) -> "Target":
        """`path`: a Hugging Face model directory, a .gguf file (or a directory holding one), or a
        short name such as `smollm2-135m-instruct` (taps.core.targets); GGUF weights load from
        their cached safetensors conversion."""
        name = target_name(path)
        path = resolve_target(path)
        if not path.is_dir():
            raise FileNotFoundError(f"target directory {path} does not exist")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: is it a Hugging Face model directory?")
        if not any(path.glob("*.safetensors")):
            raise FileNotFoundError(
                f"{path} has no *.safetensors weights; TAPS loads safetensors only (no pickle). "
                "Convert the checkpoint with `save_pretrained(..., safe_serialization=True)`."
            )

        weights = weights_identity(path)  # also refuses a truncated or corrupt weights file, naming it
        dev = resolve_device(device)
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=resolve_dtype(dtype, dev, (path, name, trust_remote_code)),
            attn_implementation=attn_implementation,
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
        ).to(dev)
        has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code) if has_tokenizer else None
        target = cls(model, tokenizer)
        target.name, target.source_dir, target._weights = name, path, weights
        return target

    # ---- facts -----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def context_window(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    @property
    def length(self) -> int:
        """Number of tokens whose KV rows are committed in the cache."""
        return kv.cache_length(self.cache)

    @property
    def feature_width(self) -> int:
        """Columns of TargetOut.features: H per captured layer."""
        return self.hidden_size * len(self.feature_layers)

    def capture(self, layers: tuple[int, ...]) -> Tensor:  # -> [len(layers) * H] long column indices
        """Also return these hidden_states indices from now on (appended, so columns already handed
        out stay valid); returns where their H columns each lie in TargetOut.features."""
        n = int(self.config.num_hidden_layers)
        for layer in layers:
            if not (layer == LAST_LAYER or 0 <= layer <= n):
                raise ValueError(f"hidden_states index {layer} is outside this target's {n + 1} hidden states")
            if layer not in self.feature_layers:
                self.feature_layers = (*self.feature_layers, layer)
        h = self.hidden_size
        blocks = [self.feature_layers.index(layer) for layer in layers]
        return torch.cat([torch.arange(b * h, (b + 1) * h) for b in blocks])

    def _features(self, hidden_states: tuple[Tensor, ...], layers: tuple[int, ...] | None = None) -> Tensor:
        """[B, T, k * H]: the hidden states of `layers` (default: the captured ones), side by side."""
        layers = self.feature_layers if layers is None else layers
        if len(layers) == 1:
            return hidden_states[layers[0]]
        return torch.cat([hidden_states[i] for i in layers], dim=-1)

    def fingerprint(self) -> str | None:
        return tokenizer_fingerprint(self.tokenizer) if self.tokenizer is not None else None

    def identity(self) -> dict[str, str]:
        """What this target's outputs depend on, by content (taps.core.identity): `target_weights`, a
        digest of its config and weights (not its tokenizer: a base model and its instruct version
        share one), and `target_dtype`, the dtype it runs in."""
        if self._weights is None:
            self._weights = tensors_identity(self.model)
        return {"target_weights": self._weights, "target_dtype": str(self.dtype).removeprefix("torch.")}

    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS ids of the generation config and tokenizer, plus the chat template's end-of-turn tokens."""
        ids: list[int] = []
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        ids += [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer is not None:
            if self.tokenizer.eos_token_id is not None:
                ids.append(self.tokenizer.eos_token_id)
            vocab = self.tokenizer.get_vocab()
            ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
        return tuple(dict.fromkeys(int(i) for i in ids))

    def _window(self) -> int | None:
        window = getattr(self.config, "sliding_window", None)
        return int(window) if window else None

    # ---- cache control ---------------------------------------------------------------------
    def reset(self) -> None:
        self.cache = kv.new_cache()
        self._tree_start = None

    def truncate(self, length: int) -> None:
        """Forget every committed token from position `length` on (e.g. to reuse a shared prefix)."""
        kv.truncate(self.cache, length)
        self._tree_start = None

    # ---- forwards --------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: Tensor, all_logits: bool = False) -> TargetOut:
        """Append ids [T] to the committed sequence (causal attention) and return their outputs."""
        if self._tree_start is not None:
            raise RuntimeError("prefill called while a tree forward awaits commit()")
        ids = ids.to(self.device, torch.long).view(1, -1)
        start = self.length
        positions = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=0 if all_logits else 1,
        )
        return TargetOut(logits=out.logits[0], features=self._features(out.hidden_states)[0])

    @torch.inference_mode()
    def encode(self, ids: Tensor, attention_mask: Tensor | None = None,
               layers: tuple[int, ...] = (LAST_LAYER,)) -> Tensor:
        """Features of whole sequences, without touching the cache (for training data): the
        hidden states of `layers` side by side (default: the last layer only).

        ids: [B, T] (or [T]); attention_mask: [B, T] with 0 on right padding. Returns [B, T, k * H].
        """
        ids = ids.to(self.device, torch.long)
        ids = ids[None] if ids.dim() == 1 else ids
        mask = None if attention_mask is None else attention_mask.to(self.device)
        out = self.model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True,
                         logits_to_keep=1)
        return self._features(out.hidden_states, layers)

    @torch.inference_mode()
    def forward_tree(self, tree: DraftTree) -> TargetOut:
        """One forward over every tree node; their KV rows are appended until commit()."""
        if self._tree_start is not None:
            raise RuntimeError("forward_tree called twice without commit()")
        prefix = self.length
        mask, depth, extra = self.tree_inputs(tree, prefix)
        out = self.model(
            input_ids=tree.tokens.to(self.device).view(1, -1),
            position_ids=(prefix + depth)[None],
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=True,
            **extra,
        )
        self._tree_start = prefix
        return TargetOut(logits=out.logits[0], features=self._features(out.hidden_states)[0])

    def tree_inputs(self, tree: DraftTree, prefix: int) -> tuple[Tensor | dict[str, Tensor], Tensor, dict]:
        """(attention_mask, node depths [N], extra keyword arguments) of a tree forward after `prefix`
        committed rows; its own method so that `taps profile` times the mask building apart."""
        depth = tree.depth().to(self.device)  # [N]
        ancestors = tree.ancestor_mask().to(self.device)  # [N, N] bool
        if not self.tree_attention:
            return self._dense_mask(ancestors, depth, prefix, tree.size), depth, {}
        # the attention applies the tree block itself; any 4D tensor stops the library from
        # building a causal mask (it takes a 4D mask as prepared), and this one is N x N
        block = attention.TreeBlock(ancestors, depth, prefix)
        return ancestors[None, None], depth, {attention.TREE_KWARG: block}

    def _dense_mask(self, ancestors: Tensor, depth: Tensor, prefix: int, size: int) -> Tensor | dict[str, Tensor]:
        """The additive mask [1, 1, N, prefix + N] (one per attention type on hybrid models), for
        models whose attention taps.core.attention does not wrap."""
        full = additive_mask(ancestors, depth, prefix, None, self.dtype)
        window = self._window()
        if window is None or prefix + size <= window:
            return full
        windowed = additive_mask(ancestors, depth, prefix, window, self.dtype)
        if getattr(self.config, "layer_types", None) is not None:  # hybrid models take one mask per attention type
            return {"full_attention": full, "sliding_attention": windowed}
        return windowed

    def commit(self, nodes: Tensor) -> None:
        """Keep exactly the KV rows of these tree nodes (root first, in path order); drop the rest."""
        if self._tree_start is None:
            raise RuntimeError("commit() without a preceding forward_tree()")
        kv.keep_rows(self.cache, self._tree_start, nodes)
        self._tree_start = None


@dataclass(frozen=True)
class TargetRef:
    """A target to load: what Target.load takes, kept in one object because it travels unloaded
    from the command line to where the loading happens (a library call, or each `--jobs` worker
    process, which loads its own copy)."""

    path: str  # a Hugging Face model directory, a .gguf file or a known name (taps.core.targets)
    device: str = "auto"
    dtype: str = "auto"
    attn: str = "sdpa"  # the target's attention implementation
    trust_remote_code: bool = False

    def load(self) -> Target:
        return Target.load(self.path, self.device, self.dtype, self.attn, self.trust_remote_code)
