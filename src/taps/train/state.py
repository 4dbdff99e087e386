"""Resumable training state: model, optimizer and RNG in safetensors, scalars in JSON.

Layout under a run directory:
    step-000100/ model.safetensors  optimizer.safetensors  rng.safetensors  state.json
    latest       name of the newest complete checkpoint
A checkpoint is written to `step-N.tmp/` and renamed into place, then `latest` is replaced
atomically, so an interrupted write never leaves a half checkpoint that resume would pick up.
No pickle anywhere: resuming never executes code from disk.
"""

from __future__ import annotations

import ast
import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from taps.core.jsonl import read_json

LATEST = "latest"


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for idx, entry in state["state"].items():
        for name, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"state.{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for key, value in meta["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(root: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict | None = None, keep: int = 2) -> Path:
    """Write the full training state at `step`; keep the newest `keep` checkpoints."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    tmp, final = root / f"{name}.tmp", root / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, tmp / "model.safetensors")
    opt_tensors, opt_meta = _flatten_optimizer(optimizer.state_dict())
    save_file(opt_tensors, tmp / "optimizer.safetensors")
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(rng, tmp / "rng.safetensors")
    state = {"step": step, "optimizer": opt_meta, "python_random": repr(random.getstate()), "extra": extra or {}}
    (tmp / "state.json").write_text(json.dumps(state))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _write_text_atomic(root / LATEST, name + "\n")
    for old in sorted(root.glob("step-*"))[:-keep]:
        if old.is_dir() and not old.name.endswith(".tmp") and old != final:
            shutil.rmtree(old)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is missing or incomplete")
    return path


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore model, optimizer and RNG from a checkpoint directory; returns its state.json dict."""
    path = Path(path)
    state = read_json(path / "state.json", "a training checkpoint's state")
    model.load_state_dict(load_file(path / "model.safetensors"), strict=True)
    optimizer.load_state_dict(_unflatten_optimizer(load_file(path / "optimizer.safetensors"), state["optimizer"]))
    rng = load_file(path / "rng.safetensors")
    torch.set_rng_state(rng["torch"])
    cuda_states = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    random.setstate(ast.literal_eval(state["python_random"]))
    return state
