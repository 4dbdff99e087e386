"""`taps serve`: argument parsing only; the work is taps.serve.launch.serve (an Engine under the
FastAPI app of taps.serve.app).

    taps serve --target DIR --drafter math=DIR_A --drafter chat=DIR_B [--variant SPEC]
               [--host 127.0.0.1 --port 8000 --max-queue 16 --max-tokens 2048]
"""

from __future__ import annotations

from taps.cli_args import (DefaultsHelpFormatter, add_device_arguments, add_settings, add_tree_arguments, settings_from,
                           speculation_from)
from taps.propose.commands import parse_named_drafter
from taps.serve.launch import ServeSettings, serve


def register(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: the target with its draft heads, one "
                                     "request at a time", formatter_class=DefaultsHelpFormatter)
    p.add_argument("--target", required=True, help="Hugging Face model directory, .gguf file or known name")
    p.add_argument("--drafter", action="append", type=parse_named_drafter, metavar="[NAME=]DIR",
                   help="a head to serve (repeat); requests name it, or compose heads by name, in "
                        "extra_body.taps.variant")
    p.add_argument("--variant", action="append", metavar="[NAME=]SPEC",
                   help="a named variant over the drafters' names (repeat), e.g. routed=route-entropy-turn:math,chat or "
                        "learned=route-bandit-turn:math,chat (learns across requests); the first is the default (default: the one drafter; several: route over all; none: "
                        "plain decoding)")
    add_settings(p, ServeSettings)
    add_tree_arguments(p)
    add_device_arguments(p)
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    serve(args.target, args.drafter or [], args.variant or [], settings_from(ServeSettings, args),
          speculation_from(args), device=args.device, dtype=args.dtype,
          announce=lambda line: print(line, flush=True))
    return 0
