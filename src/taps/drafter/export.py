"""`taps export HEAD --engine sglang|vllm|llama.cpp --out DIR`: a TAPS head as an engine loads it.

Why: SGLang and vLLM cannot load a TAPS head unchanged (drafter/layouts.py lists what each
loader does with fc's bias, the architecture name, unknown tensors and a reduced vocabulary), and
llama.cpp reads only the directory its own converter turns into a GGUF file. The export rewrites
exactly those details, row by row of layouts.LAYOUTS, and refuses in one line a head an engine
cannot express (a non-zero fc bias for vLLM, any EAGLE-2 / HASS head for llama.cpp).

The weights are the head's own, in its own dtype: nothing is retrained or re-derived. The
directory also records where it came from (`taps_export.json`, and the `taps` block of
config.json): the source head, its backbone and the sha256 of its weights, and what the engine
will do with the draft vocabulary. TAPS loads every export back (drafter/checkpoint.load_head),
which is how tests/test_export.py checks them token for token.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from taps.drafter.checkpoint import (DrafterInfo, pop_draft_vocab, read_config, read_weights, weights_digest,
                                     write_drafter)
from taps.drafter.layouts import (EAGLE3_KEYS, EAGLE_KEYS, EXPORT_RECORD, TOKEN_MAP_NAME, EngineLayout,
                                  ExportError, family_of_checkpoint, layout_for)
from taps.core.jsonl import write_json_atomic
from taps.core.outputs import check_output_dir

CONVERTER = "convert_hf_to_gguf.py"
GGUF_NAME = "head-f32.gguf"
LLAMA_CPP_ENV = "TAPS_LLAMA_CPP"  # a llama.cpp source directory (the one holding convert_hf_to_gguf.py)
# the Python that runs the converter: it needs llama.cpp's requirements (sentencepiece, ...), which
# TAPS's own environment may lack (default: this Python)
CONVERTER_PYTHON_ENV = "TAPS_LLAMA_CPP_PYTHON"


@dataclass
class Export:
    out: Path
    engine: str
    family: str
    draft_vocab: str  # what the engine drafts over, in words
    gguf: Path | None = None

    def summary(self) -> str:
        gguf = f"; GGUF {self.gguf}" if self.gguf else ""
        return (f"wrote {self.out} for {self.engine} ({self.family} head; draft vocabulary: {self.draft_vocab}){gguf}\n"
                f"serve it with: {self.launch()}")

    def launch(self) -> str:
        """The engine's command line for this export, TARGET standing for the target model (the
        settings of docs/serving.md: the paper's 60 / 5 / 10 tree for SGLang, a 5-token chain for
        vLLM, for llama.cpp an 8-token chain with its confidence stop at 0.7, measured there)."""
        if self.engine == "sglang":
            algorithm = "EAGLE3" if self.family == "eagle3" else "EAGLE"
            token_map = self.out / TOKEN_MAP_NAME
            extra = f" --speculative-token-map {token_map}" if token_map.is_file() else ""
            return (f"python -m sglang.launch_server --model-path TARGET --speculative-algorithm {algorithm} "
                    f"--speculative-draft-model-path {self.out}{extra} --speculative-num-steps 5 "
                    "--speculative-eagle-topk 10 --speculative-num-draft-tokens 60")
        if self.engine == "vllm":
            method = "eagle3" if self.family == "eagle3" else "eagle"
            return (f"vllm serve TARGET --speculative-config "
                    f"'{{\"method\": \"{method}\", \"model\": \"{self.out}\", \"num_speculative_tokens\": 5}}'")
        convert = ""
        gguf = self.gguf
        if gguf is None:  # no converter was named: convert first (LLAMA_CPP: its source directory)
            gguf = self.out / "head-bf16.gguf"
            convert = (f"python LLAMA_CPP/{CONVERTER} {self.out} --target-model-dir TARGET_DIR --outtype bf16 "
                       f"--outfile {gguf} && ")
        return (f"{convert}llama-server -m TARGET.gguf -md {gguf} --spec-type draft-eagle3 --spec-draft-n-max 8 "
                "--spec-draft-p-min 0.7")


def _check_keys(tensors: dict[str, torch.Tensor], expected: tuple[str, ...], where: Path) -> None:
    have, want = set(tensors) - {"fc.bias"}, set(expected)
    if have != want:
        missing, unexpected = sorted(want - have), sorted(have - want)
        raise ExportError(f"{where}: not a complete head of its family "
                          f"(missing {', '.join(missing) or 'none'}; unexpected {', '.join(unexpected) or 'none'})")


def _fc_bias(tensors: dict[str, torch.Tensor], layout: EngineLayout, hidden: int, where: Path) -> bool:
    """Apply the engine's fc-bias rule in place; returns whether the export has a bias."""
    bias = tensors.get("fc.bias")
    if layout.fc_bias == "zero" and bias is None:
        tensors["fc.bias"] = torch.zeros(hidden, dtype=tensors["fc.weight"].dtype)  # [H]: SGLang's fc always has one
    elif layout.fc_bias == "none" and bias is not None:
        if bool(bias.any()):
            raise ExportError(f"{where}: cannot be exported for {layout.engine}: its {layout.family} loader builds fc "
                              "without a bias, and this head's fc.bias is not zero")
        del tensors["fc.bias"]
    return "fc.bias" in tensors


def _eagle3_ids(config: dict, tensors: dict[str, torch.Tensor], layout: EngineLayout, where: Path) -> torch.Tensor:
    """The draft ids of an EAGLE-3 head, checked (its lm_head has one row per draft token), and the
    captured target layers, counted the engine's way, in both places the engines read them."""
    ids = pop_draft_vocab(tensors, config, where)
    rows = tuple(tensors["lm_head.weight"].shape)
    if ids is None and rows[0] == int(config["vocab_size"]):
        # a full-vocabulary head: written as a draft vocabulary of every token, since llama.cpp's
        # converter recognises an EAGLE-3 head by its draft_vocab_size
        ids = torch.arange(rows[0])
    elif ids is None:
        raise ExportError(f"{where / 'config.json'}: lm_head.weight has {rows[0]} rows: a draft vocabulary needs "
                          "draft_vocab_size with d2t, t2d")
    if rows[0] != ids.numel():
        raise ExportError(f"{where}: lm_head.weight has {rows[0]} rows, draft_vocab_size is {ids.numel()}")
    layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or config.get("eagle_aux_hidden_state_layer_ids")
    if not layers:
        raise ExportError(f"{where / 'config.json'}: an EAGLE-3 head must name its captured target layers "
                          "(eagle_config.eagle_aux_hidden_state_layer_ids)")
    if layout.aux_layer_count is not None and len(layers) != layout.aux_layer_count:
        raise ExportError(f"{where}: cannot be exported for {layout.engine}: its EAGLE-3 reads exactly "
                          f"{layout.aux_layer_count} captured target layers, this head has {len(layers)}")
    layers = [int(i) + layout.aux_layer_offset for i in layers]
    config["eagle_config"] = {**(config.get("eagle_config") or {}), "eagle_aux_hidden_state_layer_ids": layers}
    config["eagle_aux_hidden_state_layer_ids"] = layers
    return ids


def export_head(head: str | Path, engine: str, out: str | Path, target_model_dir: str | Path | None = None,
                llama_cpp: str | Path | None = None, force: bool = False) -> Export:
    """Write `out` for `engine` from the TAPS head directory `head` (module docstring). A drafter
    (an earlier export included) already in `out` is replaced only with force."""
    head, out = Path(head), Path(out)
    config, info = read_config(head)
    tensors = read_weights(head)
    layout = layout_for(engine, info.backbone, family_of_checkpoint(config, tensors), str(head))
    if "exported" in info.extra:
        raise ExportError(f"{head}: already an export for {info.extra['exported'].get('engine')}; export the TAPS "
                          f"head it came from ({info.extra['exported'].get('source')})")
    check_output_dir(out, "drafter", force=force, inputs=[("HEAD", head)])
    config = dict(config)
    if layout.family == "eagle3":
        ids = _eagle3_ids(config, tensors, layout, head)
        _check_keys(tensors, tuple(k for k in EAGLE3_KEYS if k not in ("d2t", "t2d")), head)
        keep_ids, vocab = ids, f"{ids.numel()} tokens (d2t / t2d)"
        if layout.engine == "vllm" and ids.numel() == int(config["vocab_size"]):
            keep_ids, vocab = None, "the full vocabulary"  # vLLM builds no d2t parameter then, and rejects one
    else:
        ids = pop_draft_vocab(tensors, config, head)
        _check_keys(tensors, EAGLE_KEYS, head)
        keep_ids = None
        if ids is None:
            vocab = "the full vocabulary"
        elif layout.draft_vocab == "token-map":
            vocab = f"{ids.numel()} tokens (--speculative-token-map {TOKEN_MAP_NAME})"
        else:
            vocab = (f"the full vocabulary (vLLM's EAGLE has no reduced vocabulary; the head was trained "
                     f"for {ids.numel()} tokens)")
    config["bias"] = _fc_bias(tensors, layout, int(config["hidden_size"]), head)
    config["architectures"] = list(layout.architectures)
    record = {"engine": engine, "family": layout.family, "source": str(head.resolve()), "head": head.name,
              "backbone": info.backbone, "weights_sha256": weights_digest(head), "draft_vocab": vocab,
              "architectures": list(layout.architectures)}
    if layout.family == "eagle3":
        record["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
    out.mkdir(parents=True, exist_ok=True)
    token_map = out / TOKEN_MAP_NAME
    for stale in (token_map, out / GGUF_NAME):
        stale.unlink(missing_ok=True)  # a rerun (another engine, another head) must not leave these behind
    exported = DrafterInfo(info.backbone, info.training_data, info.target_name, info.tokenizer_fingerprint,
                           extra={**info.extra, "exported": record})
    write_drafter(out, config, tensors, exported, keep_ids)
    if ids is not None and layout.draft_vocab == "token-map" and layout.family == "eagle":
        tmp = out / f".{TOKEN_MAP_NAME}.tmp"
        torch.save(ids.tolist(), tmp)  # SGLang: torch.load(path, weights_only=True) -> a list of target ids
        os.replace(tmp, token_map)
    gguf = _convert_gguf(out, layout, target_model_dir, llama_cpp) if layout.converter else None
    if gguf is not None:
        record["gguf"] = gguf.name
    write_json_atomic(out / EXPORT_RECORD, record)
    return Export(out, engine, layout.family, vocab, gguf)


def _convert_gguf(out: Path, layout: EngineLayout, target_model_dir, llama_cpp) -> Path | None:
    """llama.cpp: the GGUF file too, when its converter is at hand (--llama-cpp, or $TAPS_LLAMA_CPP
    with --target-model-dir: the converter reads the target's config and tokenizer)."""
    root = llama_cpp or os.environ.get(LLAMA_CPP_ENV)
    if not root or (llama_cpp is None and target_model_dir is None):
        return None  # no converter named, or only $TAPS_LLAMA_CPP and no target to convert against
    converter = Path(root) / CONVERTER
    if not converter.is_file():
        raise ExportError(f"--llama-cpp {root}: no {CONVERTER} there (a llama.cpp source directory has one)")
    if target_model_dir is None:
        raise ExportError("--target-model-dir: llama.cpp's converter needs the target's Hugging Face directory "
                          "to convert an EAGLE-3 head")
    gguf = out / GGUF_NAME
    cmd = [os.environ.get(CONVERTER_PYTHON_ENV) or sys.executable, str(converter), str(out), "--target-model-dir", str(target_model_dir),
           "--outfile", str(gguf), "--outtype", "f32"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
        hint = f"; run it with a Python that has llama.cpp's requirements (${CONVERTER_PYTHON_ENV})" \
            if "ModuleNotFoundError" in last else ""
        raise ExportError(f"{converter}: failed on {out} ({last}){hint}")
    return gguf

