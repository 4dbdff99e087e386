"""`taps serve` as one call: its options (ServeSettings, declared once as config.setting fields)
and serve(), which loads the engine and runs the server until SIGTERM / SIGINT.

FastAPI and uvicorn (the `serve` extra) load only here, when a server starts: `taps --help` and
the other commands do not need them.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from taps.core.config import SpeculationConfig, setting
from taps.core.target import TargetRef
from taps.serve.engine import Engine

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
API_KEY_ENV = "TAPS_API_KEY"


@dataclass(frozen=True)
class ServeSettings:
    # `taps serve`'s server options (cli/args.add_settings)
    host: str = setting("127.0.0.1", "address to bind (0.0.0.0 exposes the server to the network)")
    port: int = setting(8000, "port to listen on (1..65535)")
    served_model_name: str | None = setting(None, "the model id of /v1/models and requests (default: the "
                                                  "target's short name: its directory's or file's name)")
    api_key: str | None = setting(None, "clients must send Authorization: Bearer KEY on every endpoint but /health "
                                        f"(default: ${API_KEY_ENV}, which keeps the key out of the process list; "
                                        "neither: no key)")
    max_queue: int = setting(16, "requests that may wait for the decoder (>= 0); beyond them: 429 with Retry-After")
    max_tokens: int = setting(2048, "the most tokens a request may ask for (also its default, within the context "
                                    "window)", at_least=1)
    max_prompt_tokens: int | None = setting(None, "the longest prompt accepted (default: the target's context "
                                                  "window less one)", at_least=1)
    shutdown_timeout: float = setting(30.0, "on SIGTERM / SIGINT: seconds running requests may finish before they "
                                            "are cancelled")
    log_level: str = setting("info", "uvicorn's log level (info: one line per request)", choices=LOG_LEVELS)
    learn: str | None = setting(None, "learn the workload (docs/learn.md): keep finished chat answers in DIR/log/, "
                                      "draft the lookup member from them too (DIR/store/), serve adapted head versions "
                                      "from DIR/heads/NAME/vN/ (default: nothing is kept)")
    learn_log_mb: int = setting(256, "--learn: the answer log's bound in MiB (the oldest files go first)", at_least=1)
    learn_store_tokens: int = setting(2_000_000, "--learn: the online datastore's bound in tokens (the oldest "
                                                 "answers go first)", at_least=1)
    learn_check_after: int = setting(20, "--learn: a new head version is served alternately with the previous one "
                                         "until each has N requests; below its acceptance: rolled back", at_least=1)

    def __post_init__(self) -> None:  # the limits are checked by serve.app.Limits, before any model loads
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be a port number 1..65535, got {self.port}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {self.shutdown_timeout}")
        check_key(self.api_key, "--api-key")
        for option, value in (("--learn-log-mb", self.learn_log_mb), ("--learn-store-tokens", self.learn_store_tokens),
                              ("--learn-check-after", self.learn_check_after)):
            if value < 1:
                raise ValueError(f"{option} must be >= 1, got {value}")
        if self.learn is not None and os.path.exists(self.learn) and not os.path.isdir(self.learn):
            raise ValueError(f"--learn {self.learn}: not a directory; expected a directory for what the server learns")


def check_key(key: str | None, where: str) -> None:
    if key is not None and (not key or any(c.isspace() for c in key)):
        raise ValueError(f"{where} must be a non-empty token without spaces (what clients send after "
                         "'Authorization: Bearer ')")


def api_key(settings: ServeSettings) -> str | None:
    """--api-key, else $TAPS_API_KEY (set and not empty), else None."""
    if settings.api_key is not None:
        return settings.api_key
    key = os.environ.get(API_KEY_ENV) or None
    check_key(key, f"${API_KEY_ENV}")
    return key


def exposure_warning(host: str, key: str | None) -> str | None:
    """The loud warning for a server that listens beyond the loopback without a key."""
    if key is not None or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name: it may resolve to anything
        pass
    bar = "!" * 100
    return (f"{bar}\nWARNING: taps serve listens on {host} WITHOUT AN API KEY: anyone who can reach this port can "
            "decode with the model,\nread /metrics and keep the decoder busy. Set one with --api-key KEY or, "
            f"better (kept out of the process list), ${API_KEY_ENV}.\n{bar}")


def check_address(host: str, port: int) -> None:
    """Bind (host, port) once and let go, as uvicorn will (SO_REUSEADDR): a port in use or a host
    that is not this machine's is one line naming --port or --host, not a traceback after the
    model has loaded."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as err:
        raise ValueError(f"--host {host}: not an address of this machine ({err.strerror or err})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ValueError(f"--port {port}: {host}:{port} is already in use (another server?); stop it or "
                                 "choose another --port") from None
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({err.strerror or err})") from None


def serve(target: TargetRef, drafters: Sequence[tuple[str, str]] = (), variants: Sequence[str] = (),
          settings: ServeSettings = ServeSettings(), speculation: SpeculationConfig = SpeculationConfig(),
          announce: Callable[[str], None] = print) -> None:
    """Load the target (its device, dtype and attention implementation are the TargetRef's) and its heads, then serve them until SIGTERM / SIGINT (`announce` gets the
    line that says where)."""
    try:
        from taps.serve.app import Limits, create_app, run
        from taps.serve.learn import Learner
        from taps.serve.swap import HeadSwapper
    except ImportError as err:
        raise ValueError(f"taps serve needs the serve extra ({err}); install it with pip install 'taps[serve]'") from None
    key = api_key(settings)
    limits = Limits(max_queue=settings.max_queue, max_tokens=settings.max_tokens,
                    max_prompt_tokens=settings.max_prompt_tokens)
    check_address(settings.host, settings.port)  # before the model loads: a busy port fails in a second
    engine = Engine.load(target, drafters, variants, speculation, model_id=settings.served_model_name)
    log = logging.getLogger("taps.serve")  # the routing decisions (engine.ROUTING_LOG), at --log-level
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s %(message)s"))
        log.addHandler(handler)
    log.setLevel(settings.log_level.upper())
    announce(f"taps serve: {engine.model_id} on http://{settings.host}:{settings.port}/v1 (drafters: "
             f"{', '.join(engine.drafters) or 'none'}; default variant: {engine.default.label}); one request decodes "
             f"at a time, {settings.max_queue} may wait")
    warning = exposure_warning(settings.host, key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    learner = swapper = None
    if settings.learn is not None:
        learner = Learner(settings.learn, engine, max_log_bytes=settings.learn_log_mb << 20,
                          max_file_bytes=min(16, settings.learn_log_mb) << 20, store_tokens=settings.learn_store_tokens)
        swapper = HeadSwapper(settings.learn, engine, check_after=settings.learn_check_after)
    run(create_app(engine, limits, api_key=key, learner=learner, swapper=swapper), settings.host, settings.port,
        settings.shutdown_timeout, settings.log_level)
