"""Drafter checkpoints in the EAGLE layout (docs/spec.md §7), loaded strictly.

A drafter directory holds `config.json` (a LlamaConfig with num_hidden_layers 1, architectures
["LlamaForCausalLMEagle"], `bias` for fc, and a `taps` block) and `model.safetensors` with keys
`fc.weight` (+ `fc.bias`), `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight`.
No embedding, no LM head: the target's are used. A foreign checkpoint's `embed_tokens.weight`
is ignored. Anything else that does not fit is an error naming the key: a silently half-loaded
head still "works" and serves acceptance length ~1.0.

A head with a draft vocabulary of N target tokens (drafter/head.py) carries it as EAGLE-3 heads
do and SGLang reads it: config.json `"draft_vocab_size": N`, and in model.safetensors `d2t`
(int64 [N], the offset form: target id of draft index i = d2t[i] + i) and `t2d` (bool [V], True
at the target ids in the draft vocabulary). Both tensors must be there, agree with each other and
with the target's vocabulary; a head without draft_vocab_size must have neither.

Heads in the serving engines' layouts load through the same strict path (drafter/layouts.py):
vLLM's architecture and tensor names, SGLang's always-present fc.bias, and a draft vocabulary
given as SGLang's token map file instead of d2t / t2d.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer, LlamaConfig

from taps.drafter.head import DraftHead, EagleHead, head_config_for
from taps.drafter.head3 import ARCHITECTURE as EAGLE3_ARCHITECTURE
from taps.drafter.head3 import AUX_LAYERS_KEY, Eagle3Head, check_aux_layers, eagle3_config_for
from taps.drafter.layouts import (CheckpointError, family_of_checkpoint, foreign_eagle_to_taps, read_token_map,
                                  taps_layer_numbering)
from taps.core import packed
from taps.core.identity import file_sha256
from taps.core.jsonl import read_json
from taps.core.outputs import check_output_dir
from taps.core.target import tokenizer_fingerprint
from taps.core.targets import resolve_target, target_name

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1
IGNORED_FOREIGN_KEYS = ("embed_tokens.weight", "model.embed_tokens.weight")
# config.json entries that are not LlamaConfig fields of the head (or do not concern it)
NOT_HEAD_CONFIG = ("taps", "bias", "architectures", "rope_theta", "model_type", "transformers_version",
                   "torch_dtype", "dtype", "bos_token_id", "eos_token_id", "pad_token_id", "draft_vocab_size",
                   "eagle_config", AUX_LAYERS_KEY, "target_hidden_size")
DRAFT_VOCAB_KEYS = ("d2t", "t2d")


@dataclass
class DrafterInfo:
    """The `taps` block of config.json."""

    backbone: str = "eagle2"  # eagle2 | hass | untrained
    training_data: str = ""
    target_name: str = ""
    tokenizer_fingerprint: str | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format_version": FORMAT_VERSION, "backbone": self.backbone, "training_data": self.training_data,
                "target_name": self.target_name, "tokenizer_fingerprint": self.tokenizer_fingerprint, **self.extra}

    @classmethod
    def from_json(cls, block: dict) -> "DrafterInfo":
        known = {"backbone", "training_data", "target_name", "tokenizer_fingerprint", "format_version"}
        return cls(backbone=block.get("backbone", "eagle2"), training_data=block.get("training_data", ""),
                   target_name=block.get("target_name", ""),
                   tokenizer_fingerprint=block.get("tokenizer_fingerprint"),
                   extra={k: v for k, v in block.items() if k not in known})


def init_head(target_config, seed: int = 0, bias: bool = False, attn_implementation: str = "sdpa",
              backbone: str = "eagle2", draft_vocab_size: int | None = None, aux_layers=None) -> DraftHead:
    """An untrained head sized for a target, reproducible for a seed: an EAGLE-3 head for
    backbone "eagle3" (drafting over draft_vocab_size tokens, reading aux_layers), else EAGLE-2's."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if backbone == "eagle3":
            if bias:
                raise ValueError("an EAGLE-3 head's fc has no bias")
            return Eagle3Head(eagle3_config_for(target_config, draft_vocab_size, aux_layers, attn_implementation))
        return EagleHead(head_config_for(target_config, attn_implementation), bias=bias)


def _process_umask() -> int:
    """Read once, at import (setting and restoring it later would race with other threads)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _process_umask()


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes it 0600: an engine serving as another user must read a head
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def draft_vocab_tensors(draft_ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """`d2t` [N] int64 (offset form: d2t[i] = target id of draft index i - i) and `t2d` [V] bool."""
    ids = draft_ids.detach().long().cpu()  # [N]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
    t2d[ids] = True
    return {"d2t": ids - torch.arange(ids.numel()), "t2d": t2d}


def pop_draft_vocab(tensors: dict[str, torch.Tensor], config: dict, path: str | Path) -> torch.Tensor | None:
    """Take `d2t` / `t2d` out of a drafter's tensors and return its draft ids [N] (None: the full
    vocabulary), checked strictly against config.json's draft_vocab_size and vocab_size. Without
    draft_vocab_size nothing is taken, so stray d2t / t2d stay behind as unexpected keys."""
    path = Path(path)
    n = config.get("draft_vocab_size")
    if n is None:
        return None
    v = config["vocab_size"]
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= v:
        raise CheckpointError(f"{path / CONFIG_NAME}: draft_vocab_size is {n!r}, expected an integer in "
                              f"[1, vocab_size {v}]")
    weights = path / WEIGHTS_NAME
    missing = [key for key in DRAFT_VOCAB_KEYS if key not in tensors]
    if missing:
        raise CheckpointError(f"{weights}: missing key(s) {', '.join(missing)} (config.json has draft_vocab_size {n})")
    d2t, t2d = tensors.pop("d2t"), tensors.pop("t2d")
    if tuple(d2t.shape) != (n,) or d2t.dtype not in (torch.int64, torch.int32):
        raise CheckpointError(f"{weights}: key d2t is {d2t.dtype} {tuple(d2t.shape)}, expected int64 ({n},) "
                              "(draft_vocab_size)")
    if tuple(t2d.shape) != (v,) or t2d.dtype != torch.bool:
        raise CheckpointError(f"{weights}: key t2d is {t2d.dtype} {tuple(t2d.shape)}, expected bool ({v},) "
                              "(vocab_size)")
    ids = d2t.long() + torch.arange(n)  # [N] target ids
    if int(ids.min()) < 0 or int(ids.max()) >= v:
        raise CheckpointError(f"{weights}: key d2t maps draft indices to target ids "
                              f"{int(ids.min())}..{int(ids.max())}, outside [0, {v}) (target id = d2t[i] + i)")
    if n > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise CheckpointError(f"{weights}: key d2t: the target ids d2t[i] + i must be distinct and ascending")
    if int(t2d.sum()) != n or not bool(t2d[ids].all()):
        raise CheckpointError(f"{weights}: key t2d does not mark exactly the {n} target ids of d2t "
                              f"({int(t2d.sum())} marked)")
    return ids


def write_drafter(out_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor], info: DrafterInfo,
                  draft_ids: torch.Tensor | None = None) -> Path:
    """Write a drafter directory from a config dict and head tensors (each file replaced
    atomically); with draft_ids, also draft_vocab_size, d2t and t2d."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in config.items() if k != "draft_vocab_size"}
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items() if k not in DRAFT_VOCAB_KEYS}
    if draft_ids is not None:
        config["draft_vocab_size"] = int(draft_ids.numel())
        tensors.update(draft_vocab_tensors(draft_ids, int(config["vocab_size"])))
    config["taps"] = info.to_json()
    _atomic_write(out / WEIGHTS_NAME, lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    _atomic_write(out / CONFIG_NAME, lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))
    return out


def save_head(head: DraftHead, out_dir: str | Path, info: DrafterInfo, export_fc_bias: bool = False) -> Path:
    """Write config.json + model.safetensors; each file is replaced atomically.

    export_fc_bias writes a zero `fc.bias` for engines that always build fc with a bias (SGLang's
    EAGLE-2 loader). A head's draft vocabulary is written as draft_vocab_size + d2t + t2d (module
    docstring). An EAGLE-3 head is written in the engines' EAGLE-3 layout (drafter/head3.py).
    """
    tensors = dict(head.state_dict())
    config = head.config.to_dict()
    config.pop("_attn_implementation", None)
    config["num_hidden_layers"] = 1
    if isinstance(head, Eagle3Head):
        if export_fc_bias:
            raise ValueError("an EAGLE-3 head's fc has no bias")
        config["architectures"] = [EAGLE3_ARCHITECTURE]
        config["bias"] = False
        config[AUX_LAYERS_KEY] = list(head.aux_layers)
        config["eagle_config"] = {AUX_LAYERS_KEY: list(head.aux_layers), "use_aux_hidden_state": True}
    else:
        bias = head.bias
        if export_fc_bias and "fc.bias" not in tensors:
            tensors["fc.bias"] = torch.zeros(head.config.hidden_size, dtype=tensors["fc.weight"].dtype)
            bias = True
        config["architectures"] = ["LlamaForCausalLMEagle"]
        config["bias"] = bias
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]  # top-level copy for engines that read it there
    return write_drafter(out_dir, config, tensors, info, head.draft_ids)


def weights_digest(drafter_dir: str | Path) -> str:
    """sha256 of a drafter's model.safetensors (bare hex, as results record it): results measured
    with other weights are never reused."""
    return file_sha256(Path(drafter_dir) / "model.safetensors")


def read_config(path: str | Path) -> tuple[dict, DrafterInfo]:
    cfg_path = Path(path) / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: missing; a drafter directory needs config.json and {WEIGHTS_NAME}")
    config = read_json(cfg_path, "a drafter's config (an object of head sizes)", CheckpointError)
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size"):
        if key not in config:
            raise CheckpointError(f"{cfg_path}: key '{key}' is missing")
    if config.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"{cfg_path}: num_hidden_layers is {config['num_hidden_layers']}, an EAGLE head has 1")
    return config, DrafterInfo.from_json(config.get("taps") or {})


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The head tensors of a drafter directory (safetensors only; a foreign embedding dropped),
    every floating-point one finite."""
    path = Path(path)
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth")) if path.is_dir() else []
        hint = f" (found {', '.join(other)}: TAPS loads safetensors only)" if other else ""
        raise CheckpointError(f"{weights}: missing{hint}")
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{weights}: not a readable safetensors file ({err})") from None
    for key in IGNORED_FOREIGN_KEYS:
        tensors.pop(key, None)
    for key, value in sorted(tensors.items()):  # a NaN or Inf weight drafts garbage without any error
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise CheckpointError(f"{weights}: key {key} holds {bad} non-finite value(s) (NaN or Inf); a diverged "
                                  "or corrupt checkpoint, retrain or restore it")
    return tensors


def load_head(path: str | Path, target, attn_implementation: str = "sdpa") -> DraftHead:
    """Load a drafter strictly for `target` (a taps Target), bound to its embedding and LM head.
    Its `taps` block (DrafterInfo) is read_config(path)[1]."""
    path = Path(path)
    config, info = read_config(path)
    cfg_path = path / CONFIG_NAME
    if config["hidden_size"] != target.hidden_size:
        raise CheckpointError(f"{cfg_path}: hidden_size is {config['hidden_size']}, the target's is {target.hidden_size}")
    if config["vocab_size"] != target.vocab_size:
        raise CheckpointError(f"{cfg_path}: vocab_size is {config['vocab_size']}, the target's LM head has {target.vocab_size}")
    theirs, ours = info.tokenizer_fingerprint, target.fingerprint()
    if theirs is not None and ours is not None and theirs != ours:
        raise CheckpointError(
            f"{cfg_path}: taps.tokenizer_fingerprint {theirs} does not match the target tokenizer's {ours}: "
            "this drafter was trained for another tokenizer")
    if theirs is None:
        warnings.warn(f"{cfg_path}: no taps.tokenizer_fingerprint (foreign checkpoint?); tokenizer not checked")

    weights = path / WEIGHTS_NAME
    tensors = read_weights(path)
    eagle3 = family_of_checkpoint(config, tensors) == "eagle3"  # by architecture or by its midlayer tensors
    if eagle3:
        config = taps_layer_numbering(config, info.extra.get("exported"))
    else:
        tensors = foreign_eagle_to_taps(config, tensors, path)
    draft_ids = pop_draft_vocab(tensors, config, path)
    if draft_ids is None and not eagle3:
        draft_ids = read_token_map(path, config["vocab_size"])  # an SGLang export's --speculative-token-map

    fields = {k: v for k, v in config.items() if k not in NOT_HEAD_CONFIG}
    if "rope_parameters" not in fields and "rope_theta" in config:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    try:
        head_config = LlamaConfig(**fields)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{cfg_path}: not a valid Llama head config ({err})") from None
    head_config._attn_implementation = attn_implementation if attn_implementation in ("eager", "sdpa") else "sdpa"
    if eagle3:
        head = Eagle3Head(_eagle3_fields(head_config, config, target, cfg_path, draft_ids))
    else:
        head = EagleHead(head_config, bias=bool(config.get("bias", "fc.bias" in tensors)))

    expected = head.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"{weights}: missing key(s) {', '.join(missing)}")
    if unexpected:
        raise CheckpointError(f"{weights}: unexpected key(s) {', '.join(unexpected)}")
    for key, value in expected.items():
        if tuple(tensors[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"{weights}: key {key} has shape {tuple(tensors[key].shape)}, expected {tuple(value.shape)} for this target")
    head.load_state_dict(tensors, strict=True)
    head = head.to(device=target.device, dtype=target.dtype).eval().set_draft_vocab(draft_ids)
    packed.pack_linears(head)  # on a CPU: drafting multiplies by packed weights (taps.core.packed)
    return head.attach(target)


def _eagle3_fields(head_config: LlamaConfig, config: dict, target, cfg_path: Path, draft_ids) -> LlamaConfig:
    """The EAGLE-3 entries of config.json, checked against the target: the layers it reads (top
    level or under eagle_config; the engines' default without either), their width and the draft
    vocabulary's size."""
    layers = int(target.config.num_hidden_layers)
    nested = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    aux = config.get(AUX_LAYERS_KEY, nested.get(AUX_LAYERS_KEY))
    try:
        ref = eagle3_config_for(target.config, config.get("draft_vocab_size"), aux)
        if aux is not None:
            check_aux_layers(aux, layers, str(cfg_path))
    except ValueError as err:
        raise CheckpointError(str(err) if str(cfg_path) in str(err) else f"{cfg_path}: {err}") from None
    width = config.get("target_hidden_size", target.hidden_size)
    if width != target.hidden_size:
        raise CheckpointError(f"{cfg_path}: target_hidden_size is {width}, the target's hidden size is {target.hidden_size}")
    for key in ("architectures", "draft_vocab_size", "target_hidden_size", AUX_LAYERS_KEY):
        setattr(head_config, key, getattr(ref, key))
    if draft_ids is None and ref.draft_vocab_size != ref.vocab_size:
        raise CheckpointError(f"{cfg_path}: draft_vocab_size {ref.draft_vocab_size} needs d2t / t2d in {WEIGHTS_NAME}")
    return head_config


def write_untrained(target_dir: str | Path, out_dir: str | Path, seed: int = 0, bias: bool = False,
                    backbone: str = "eagle2", force: bool = False) -> Path:
    """`taps drafter init`: an untrained head for the target in `target_dir`, read from its config
    and tokenizer only (the target's weights are not loaded). An existing head in `out_dir` is
    replaced only with `force` (taps.core.outputs)."""
    check_output_dir(out_dir, "drafter", force=force, inputs=[("--target", target_dir)])
    name = target_name(target_dir)
    target_dir = resolve_target(target_dir)
    if not (target_dir / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{target_dir / CONFIG_NAME}: missing; --target must be a Hugging Face model directory")
    config = AutoConfig.from_pretrained(target_dir)
    try:
        fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(target_dir))
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"{target_dir}: no loadable tokenizer ({err})") from None
    try:
        head = init_head(config, seed=seed, bias=bias, backbone=backbone)
    except ValueError as err:
        raise CheckpointError(f"{target_dir}: {err}") from None
    info = DrafterInfo(backbone="untrained", target_name=name, tokenizer_fingerprint=fingerprint,
                       extra={"seed": seed, "architecture": backbone})
    return save_head(head, out_dir, info)
