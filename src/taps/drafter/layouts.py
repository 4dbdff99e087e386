"""What each serving engine's EAGLE loader reads, as one table; and the foreign layouts TAPS reads.

Why a table: SGLang, vLLM and llama.cpp each load an EAGLE head with their own model class, and
they disagree on the details that decide whether a head loads at all, or loads half-initialised
and serves acceptance ~1.0 (tests/test_engine_contracts.py cites the loader code each row is
read from):

- SGLang `LlamaForCausalLMEagle` builds `fc` WITH a bias and keeps a random one when the
  checkpoint has none; it ignores d2t / t2d, and takes a reduced vocabulary as a separate token
  map file (`--speculative-token-map`, a torch.save'd list of target ids).
- vLLM renames the architecture (`LlamaForCausalLM` -> `EagleLlamaForCausalLM` for method
  "eagle"; a `LlamaForCausalLMEagle` would become an unregistered class); its `fc` has no bias;
  some versions raise KeyError on any tensor name they do not know; its EAGLE path drafts over the
  target's whole vocabulary (there is no token map), so a reduced vocabulary is dropped: the
  documented full-vocabulary fallback.
- EAGLE-3 (`LlamaForCausalLMEagle3`, the SpecForge layout) is a different network: `midlayer.*`,
  `fc` over three target layers, its own `norm` and `lm_head`, `d2t` / `t2d`; both engines read that
  layout as it is. llama.cpp drafts with EAGLE-3 heads only (architecture `eagle3`, converted by
  its `convert_hf_to_gguf.py --target-model-dir`), and has no EAGLE-2 path (its converter would
  even take a one-layer head with draft_vocab_size for an EAGLE-3 one).
- The captured target layers (`eagle_aux_hidden_state_layer_ids`) are counted two ways. SGLang
  (and SpecForge, which trains with it; TAPS's eagle3 layout follows them) names layer i for the
  OUTPUT of layer i (set_eagle3_layers_to_capture adds 1); vLLM and llama.cpp name layer j for the
  INPUT of layer j (0 = the embedding). An export for those two adds 1 to every id.

A family is the network: "eagle" (TAPS's eagle2 and hass backbones: one network, two training
objectives) or "eagle3"; an untrained head's family is its tensors'. Adding an engine or a family
is adding rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

ENGINES = ("sglang", "vllm", "llama.cpp")
FAMILY_OF_BACKBONE = {"eagle2": "eagle", "hass": "eagle", "untrained": "eagle", "eagle3": "eagle3"}
TOKEN_MAP_NAME = "hot_token_map.pt"  # SGLang's --speculative-token-map, written beside the weights
EXPORT_RECORD = "taps_export.json"
AUX_LAYERS = "eagle_aux_hidden_state_layer_ids"

EAGLE_KEYS = ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
              "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
              "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
              "layers.0.post_attention_layernorm.weight")
EAGLE3_KEYS = ("fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
               "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
               "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
               "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
               "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
# architectures an EAGLE (1/2, HASS) checkpoint may name: TAPS / SGLang, the EAGLE authors' and
# vLLM's input name, and vLLM's class name after its rename
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle", "LlamaForCausalLM", "EagleLlamaForCausalLM")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# vLLM's `speculators` format names for the EAGLE head's tensors (vllm llama_eagle.py SPECULATORS_WEIGHT_MAP)
SPECULATORS_NAMES = {"fusion_fc.weight": "fc.weight", "fusion_fc.bias": "fc.bias"}


class CheckpointError(ValueError):
    """A drafter checkpoint that does not fit the target (or is not a drafter checkpoint)."""


class ExportError(ValueError):
    """A head an engine cannot express (one line: which engine, and why)."""


@dataclass(frozen=True)
class EngineLayout:
    """How one engine loads one family of heads.

    fc_bias: "zero" writes a zero fc.bias when the head has none (the engine always builds one);
    "none" drops an all-zero bias and refuses a non-zero one (the engine builds none).
    draft_vocab: "token-map" (a separate file of target ids), "d2t" (d2t / t2d in the weights),
    "full" (dropped: the engine drafts over the whole vocabulary).
    """

    engine: str
    family: str
    architectures: tuple[str, ...] = ()
    fc_bias: str = "keep"
    draft_vocab: str = "d2t"
    aux_layer_offset: int = 0  # EAGLE-3: added to the captured layer ids (module docstring)
    aux_layer_count: int | None = None  # EAGLE-3: how many captured layers the engine takes (None: any)
    refusal: str | None = None  # why this engine cannot take this family at all
    converter: str | None = None  # llama.cpp: the GGUF conversion step


LAYOUTS: dict[tuple[str, str], EngineLayout] = {
    ("sglang", "eagle"): EngineLayout("sglang", "eagle", ("LlamaForCausalLMEagle",), fc_bias="zero",
                                      draft_vocab="token-map"),
    ("vllm", "eagle"): EngineLayout("vllm", "eagle", ("LlamaForCausalLM",), fc_bias="none", draft_vocab="full"),
    ("llama.cpp", "eagle"): EngineLayout(
        "llama.cpp", "eagle", refusal="llama.cpp has no EAGLE-2 / HASS path: its speculative decoding drafts with "
                                      "EAGLE-3 heads (architecture eagle3) or a separate draft model"),
    ("sglang", "eagle3"): EngineLayout("sglang", "eagle3", ("LlamaForCausalLMEagle3",)),
    # vLLM's EAGLEConfig(method="eagle3") turns LlamaForCausalLM into Eagle3LlamaForCausalLM, registered in
    # every vLLM with EAGLE-3 (LlamaForCausalLMEagle3 is registered only in later ones)
    ("vllm", "eagle3"): EngineLayout("vllm", "eagle3", ("LlamaForCausalLM",), fc_bias="none", aux_layer_offset=1),
    ("llama.cpp", "eagle3"): EngineLayout("llama.cpp", "eagle3", ("LlamaForCausalLMEagle3",), fc_bias="none",
                                          aux_layer_offset=1, aux_layer_count=3,
                                          converter="convert_hf_to_gguf.py DIR --target-model-dir TARGET"),
}


def layout_for(engine: str, backbone: str, family: str, where: str) -> EngineLayout:
    """The row for a head of this backbone whose tensors are of `family` (an untrained head's
    family is its tensors'), or an ExportError naming what is missing or does not agree."""
    if backbone not in FAMILY_OF_BACKBONE:
        raise ExportError(f"{where}: backbone {backbone!r} is not one TAPS exports "
                          f"(known: {', '.join(FAMILY_OF_BACKBONE)})")
    if backbone != "untrained" and FAMILY_OF_BACKBONE[backbone] != family:
        raise ExportError(f"{where}: its backbone is {backbone} but its tensors are an {family} head")
    if engine not in ENGINES:
        raise ExportError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
    layout = LAYOUTS[(engine, family)]
    if layout.refusal:
        raise ExportError(f"{where}: this {backbone} head cannot be exported for {engine}: {layout.refusal}")
    return layout


def family_of_checkpoint(config: dict, tensors: dict[str, torch.Tensor]) -> str:
    """'eagle3' for an EAGLE-3 checkpoint (its architecture, or its midlayer tensors), else 'eagle'."""
    archs = config.get("architectures") or []
    if any(a in EAGLE3_ARCHITECTURES for a in archs) or any(k.startswith("midlayer.") for k in tensors):
        return "eagle3"
    return "eagle"


def foreign_eagle_to_taps(config: dict, tensors: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """An EAGLE checkpoint in an engine's layout, renamed to TAPS's keys (checked strictly later by
    the loader): vLLM speculators names, a `model.` prefix. A named architecture must be one an
    EAGLE (1/2, HASS) head is published under: anything else is not this network."""
    archs = config.get("architectures") or []
    if archs and not any(a in EAGLE_ARCHITECTURES for a in archs):
        raise CheckpointError(f"{path / 'config.json'}: architectures {archs} is not an EAGLE head layout TAPS "
                              f"reads (expected one of {', '.join(EAGLE_ARCHITECTURES + EAGLE3_ARCHITECTURES)})")
    out = {}
    for key, value in tensors.items():
        key = SPECULATORS_NAMES.get(key, key)
        if key.startswith("model.") and key[len("model."):] not in tensors:
            key = key[len("model."):]
        if key in out:
            raise CheckpointError(f"{path / 'model.safetensors'}: key {key} appears twice (with and without a prefix)")
        out[key] = value
    return out


def taps_layer_numbering(config: dict, exported: dict | None) -> dict:
    """An EAGLE-3 config with its captured layers numbered TAPS's way (SGLang's: the output of layer
    i). A TAPS export for vLLM or llama.cpp numbers them by their input (`exported` is its record,
    the `taps.exported` block): the export's offset is taken back off. Any other checkpoint is read
    as SpecForge and SGLang write it."""
    layout = LAYOUTS.get(((exported or {}).get("engine"), "eagle3"))
    if layout is None or not layout.aux_layer_offset:
        return config
    config = dict(config)
    holders = [config]
    if isinstance(config.get("eagle_config"), dict):
        config["eagle_config"] = dict(config["eagle_config"])
        holders.append(config["eagle_config"])
    for holder in holders:
        if isinstance(holder.get(AUX_LAYERS), list):
            holder[AUX_LAYERS] = [i - layout.aux_layer_offset if isinstance(i, int) else i for i in holder[AUX_LAYERS]]
    return config


def read_token_map(path: Path, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary an SGLang export carries as its token map (None without one): [N] long
    target ids, checked like d2t (within the vocabulary, distinct); returned ascending."""
    file = path / TOKEN_MAP_NAME
    if not file.is_file():
        return None
    try:
        ids = torch.as_tensor(torch.load(file, weights_only=True))
    except Exception as err:  # noqa: BLE001 (a torch.load of a bad file raises many kinds)
        raise CheckpointError(f"{file}: not a readable token map ({type(err).__name__}: {err})") from None
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise CheckpointError(f"{file}: expected a non-empty 1-D list of target ids, got {ids.dtype} {tuple(ids.shape)}")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise CheckpointError(f"{file}: target ids {int(ids.min())}..{int(ids.max())} outside [0, {vocab_size})")
    ids = ids.sort().values
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise CheckpointError(f"{file}: the target ids must be distinct")
    return ids
