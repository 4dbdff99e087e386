"""Argument groups that several subcommands share, spelled once so their names and defaults agree."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from dataclasses import fields

from taps.core.config import AUTO_TREE_CAPS, DEVICE_PATTERN, FIXED_TREE, SEED_LIMIT, TREE_MODES, SpeculationConfig
from taps.core.target import TargetRef

DTYPES = ["auto", "float32", "bfloat16", "float16"]


def add_tree_arguments(p) -> None:
    """The speculation settings (config.SpeculationConfig): `--tree fixed|auto` and the EAGLE-2
    tree shape, whose defaults are the chosen mode's (fixed: the paper's 60/5/10; auto: the caps)."""
    fixed, caps = FIXED_TREE, AUTO_TREE_CAPS
    p.add_argument("--total-tokens", type=positive_int, default=None,
                   help=f"tree budget, root included (default {fixed.total_tokens}; --tree auto: the cap, default "
                        f"{caps.total_tokens})")
    p.add_argument("--depth", type=positive_int, default=None,
                   help=f"draft levels below the root (default {fixed.depth}; auto: {caps.depth})")
    p.add_argument("--top-k", type=positive_int, default=None,
                   help=f"tree beam width / branching (default {fixed.top_k}; auto: {caps.top_k})")
    p.add_argument("--tree", choices=list(TREE_MODES), default="fixed",
                   help="fixed: the shape above every step; auto: per step, the depth and size that maximise "
                        "expected tokens/s from this machine's measured costs (taps profile)")


def speculation_from(args) -> SpeculationConfig:
    """The speculation settings of the options add_tree_arguments made."""
    return SpeculationConfig.of(args.tree, args.total_tokens, args.depth, args.top_k)


def device_arg(text: str) -> str:
    """--device: checked when parsed, so a typo fails before any model loads or worker starts."""
    if not re.fullmatch(DEVICE_PATTERN, text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda, cuda:N or mps, got {text!r}")
    return text


def _int_in(text: str, low: int, high: int | None, expected: str) -> int:
    """An integer in [low, high) (high None: no upper bound), or the option's one-line error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low or (high is not None and value >= high):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (counts, sizes, lengths: 0 or a negative number is a mistake, not 'none')."""
    return _int_in(text, 1, None, "an integer >= 1")


def number_list(text: str) -> tuple[float, ...]:
    """Comma-separated finite numbers >= 0 (sampling temperatures)."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) and v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated finite numbers >= 0, got {text!r}")
    return values


def finite_float(text: str) -> float:
    """A finite number: nan and inf parse as floats but mean nothing as a temperature, a
    probability or a learning rate, and would reach the decoder or the optimizer unchecked."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a sampling temperature: 0 is greedy)."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def seed_int(text: str) -> int:
    """A random seed: an integer in [0, 2^63), the range every generator here accepts."""
    return _int_in(text, 0, SEED_LIMIT, "an integer seed in [0, 2^63)")


def comma_list(text: str) -> list[str]:
    """Comma-separated items (empty ones dropped)."""
    return [item for item in text.split(",") if item.strip()]


def add_device_arguments(p) -> None:
    p.add_argument("--device", type=device_arg, default="auto", help="auto | cpu | cuda | cuda:N (under accelerate: this process's)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="auto: bf16 on GPUs; on a CPU the faster of bf16 and float32 for a verify step, measured "
                        "once and cached (exact greedy identity needs float32)")


def add_attn_argument(p) -> None:
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="target attention implementation")


def target_ref(args, **fixed) -> TargetRef:
    """The target a command names, as the TargetRef its library call loads: --target, and those of
    --device, --dtype, --attn and --trust-remote-code the command has; `fixed` sets the fields it
    has no option for (or whose option is named otherwise, such as `taps features --target-dtype`)."""
    given = {name: getattr(args, name) for name in ("device", "dtype", "attn", "trust_remote_code")
             if hasattr(args, name)}
    return TargetRef(args.target, **{**given, **fixed})


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends an option's default to its help, except where there is none to show.

    argparse's own formatter writes "(default: None)" after options whose help already says what
    an unset value means (e.g. "(default: $TAPS_DATA_DIR)"), which reads as a contradiction.
    """

    def _get_help_string(self, action) -> str:
        if action.default is None or "(default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def add_settings(p, cls, only: Sequence[str] | None = None) -> None:
    """One option per field of the settings dataclass `cls` declared with config.setting (all of
    them, or those named in `only`): its flag, type, default and help come from the field."""
    for f in fields(cls):
        option = f.metadata.get("option")
        if option is None or (only is not None and f.name not in only):
            continue
        kwargs = {"dest": f.name, "default": f.default, "help": option["help"]}
        kind = str(f.type).split("|")[0].strip()
        if kind == "bool":  # a setting that is on by default gets its --no-FLAG too
            kwargs["action"] = argparse.BooleanOptionalAction if f.default is True else "store_true"
        else:
            kwargs["type"] = (positive_int if option["at_least"] == 1 else seed_int if f.name == "seed"
                              else {"int": int, "float": finite_float, "str": str}[kind])
            for key in ("choices", "metavar"):
                if option[key] is not None:
                    kwargs[key] = list(option[key]) if key == "choices" else option[key]
        p.add_argument(option["flag"] or "--" + f.name.replace("_", "-"), **kwargs)


def settings_from(cls, args, **others):
    """An instance of `cls` from the options add_settings made (and `others`, its remaining fields)."""
    given = {f.name: getattr(args, f.name) for f in fields(cls) if "option" in f.metadata and f.name not in others}
    return cls(**given, **others)
