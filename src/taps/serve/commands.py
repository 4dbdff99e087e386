"""`taps serve`: argument parsing only; the server is taps.serve.app over a taps.serve.engine.Engine.

    taps serve --target DIR --drafter math=DIR_A --drafter chat=DIR_B [--variant SPEC]
               [--host 127.0.0.1 --port 8000 --max-queue 16 --max-tokens 2048]
"""

from __future__ import annotations

import argparse

from taps.cli_args import DefaultsHelpFormatter, add_device_arguments, add_tree_arguments, positive_int, tree_shape


def _number(kind: type, low: float, high: float | None, what: str):
    """An argparse type: a `kind` number in [low, high], refused naming `what` was expected."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value >= low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_port = _number(int, 1, 65535, "a port number 1..65535")
_non_negative = _number(int, 0, None, "an integer >= 0")
_seconds = _number(float, 0.0, None, "a number of seconds >= 0")


def register(sub) -> None:
    from taps.propose.commands import parse_named_drafter

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: the target with its draft heads, one "
                                     "request at a time", formatter_class=DefaultsHelpFormatter)
    p.add_argument("--target", required=True, help="Hugging Face model directory, .gguf file or known name")
    p.add_argument("--drafter", action="append", type=parse_named_drafter, metavar="[NAME=]DIR",
                   help="a head to serve (repeat); requests name it, or compose heads by name, in "
                        "extra_body.taps.variant")
    p.add_argument("--variant", action="append", metavar="[NAME=]SPEC",
                   help="a named variant over the drafters' names (repeat), e.g. routed=route-entropy-turn:math,chat; "
                        "the first is the default (default: the one drafter; several: route over all; none: "
                        "plain decoding)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server to the network)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on")
    p.add_argument("--served-model-name", help="the model id of /v1/models and requests (default: --target as given)")
    p.add_argument("--max-queue", type=_non_negative, default=16,
                   help="requests that may wait for the decoder; beyond them: 429 with Retry-After")
    p.add_argument("--max-tokens", type=positive_int, default=2048,
                   help="the most tokens a request may ask for (also its default, within the context window)")
    p.add_argument("--max-prompt-tokens", type=positive_int, help="the longest prompt accepted (default: the "
                                                                  "target's context window less one)")
    p.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                   help="on SIGTERM / SIGINT: seconds running requests may finish before they are cancelled")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info: one line per request)")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="target attention implementation")
    add_tree_arguments(p, auto=True)
    add_device_arguments(p)
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    try:
        from taps.serve.app import Limits, create_app, run
    except ImportError as err:
        raise ValueError(f"taps serve needs the serve extra ({err}); install it with pip install 'taps[serve]'") from None
    from taps.config import TreeConfig
    from taps.serve.engine import Engine

    limits = Limits(max_queue=args.max_queue, max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens)
    engine = Engine.load(args.target, args.drafter or [], args.variant or [], TreeConfig(*tree_shape(args)),
                         auto_tree=args.tree == "auto", device=args.device, dtype=args.dtype,
                         attn_implementation=args.attn, model_id=args.served_model_name)
    print(f"taps serve: {engine.model_id} on http://{args.host}:{args.port}/v1 (drafters: "
          f"{', '.join(engine.drafters) or 'none'}; default variant: {engine.default.label}); one request decodes "
          f"at a time, {args.max_queue} may wait", flush=True)
    run(create_app(engine, limits), args.host, args.port, args.shutdown_timeout, args.log_level)
    return 0
