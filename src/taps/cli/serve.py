"""`taps serve`: argument parsing only; the work is taps.serve.launch.serve (an Engine under the
FastAPI app of taps.serve.app).

    taps serve --target DIR --drafter math=DIR_A --drafter chat=DIR_B [--variant SPEC]
               [--host 127.0.0.1 --port 8000 --max-queue 16 --max-tokens 2048] [--learn DIR]
    taps adapt DIR --head NAME --target T [--base HEAD_DIR] [--mix FEATURES[:N]]
"""

from __future__ import annotations

from taps.cli.args import (DefaultsHelpFormatter, add_attn_argument, add_device_arguments, add_settings,
                           add_tree_arguments, device_arg, settings_from, speculation_from, target_ref)
from taps.cli.propose import parse_named_drafter
from taps.serve.adapt import AdaptSettings, adapt
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
    add_attn_argument(p)
    p.set_defaults(func=_serve)

    a = sub.add_parser("adapt", help="fine-tune a served head on the answers `taps serve --learn DIR` logged; write "
                                     "DIR/heads/NAME/vN+1 only if it drafts the held-out requests better (resumable)",
                       formatter_class=DefaultsHelpFormatter)
    a.add_argument("dir", metavar="DIR", help="the directory given to taps serve --learn")
    a.add_argument("--head", required=True, metavar="NAME", help="the --drafter name the server serves it as")
    a.add_argument("--target", required=True, help="the served target (Hugging Face model directory, .gguf file or "
                                                   "known name)")
    a.add_argument("--base", metavar="HEAD_DIR", help="the head served as NAME (its --drafter directory): needed "
                                                      "while DIR/heads/NAME holds no version")
    a.add_argument("--mix", action="append", default=[], metavar="FEATURES[:N]",
                   help="also train on (the first N records of) the head's original features, against forgetting "
                        "(repeat)")
    add_settings(a, AdaptSettings)
    a.add_argument("--device", type=device_arg, default="auto", help="auto | cpu | cuda | cuda:N")
    a.set_defaults(func=_adapt)


def _serve(args) -> int:
    serve(target_ref(args), args.drafter or [], args.variant or [], settings_from(ServeSettings, args),
          speculation_from(args), announce=lambda line: print(line, flush=True))
    return 0


def _adapt(args) -> int:
    print(adapt(args.dir, args.head, target_ref(args), args.base, settings_from(AdaptSettings, args),
                args.mix, say=lambda line: print(line, flush=True)))
    return 0
