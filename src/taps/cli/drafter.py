"""`taps export`: argument parsing only; the work is drafter/export.py.

    taps export HEAD --engine sglang|vllm|llama.cpp --out DIR [--target-model-dir T --llama-cpp SRC] [--force]
"""

from __future__ import annotations

from taps.drafter.export import LLAMA_CPP_ENV, export_head
from taps.drafter.layouts import ENGINES


def register(sub) -> None:
    p = sub.add_parser("export", help="write a TAPS head as SGLang, vLLM or llama.cpp loads it (docs/serving.md)")
    p.add_argument("head", metavar="HEAD", help="a TAPS drafter directory (config.json + model.safetensors)")
    p.add_argument("--engine", required=True, choices=ENGINES, help="the serving engine whose EAGLE loader reads DIR")
    p.add_argument("--out", required=True, help="output directory (config.json, model.safetensors, taps_export.json, "
                                                "and SGLang's token map when the head has a draft vocabulary)")
    p.add_argument("--target-model-dir", help="llama.cpp (EAGLE-3 heads): the target's Hugging Face directory, "
                                              "which llama.cpp's converter reads too")
    p.add_argument("--llama-cpp", metavar="SRC", help=f"llama.cpp source directory: also write the GGUF file with its "
                                                      f"convert_hf_to_gguf.py (default: ${LLAMA_CPP_ENV})")
    p.add_argument("--force", action="store_true", help="replace a drafter or an export already in --out")
    p.set_defaults(func=_export)


def _export(args) -> int:
    print(export_head(args.head, args.engine, args.out, args.target_model_dir, args.llama_cpp, args.force).summary())
    return 0
