"""`taps average`: argument parsing only; the work is in drafter/average.py.

    taps average --drafter math=DIR_A --drafter chat=DIR_B [--weight 0.5 --weight 0.5] --out DIR
    taps average --drafter A --drafter B --sweep [--lambdas 0.1,0.5,0.9] --out ROOT   (ROOT/lambda-<l>)

Also `taps generate`'s composition options: `--variant SPEC` (the grammar of propose/spec.py), or
its sugar, several `--drafter [NAME=]DIR` with `--strategy single|average|route|merge`, `--signal`,
`--granularity`, `--merge-mode` and `--weight`, which build the same VariantSpec (composition()).
"""

from __future__ import annotations

import argparse

from taps.cli.args import DefaultsHelpFormatter
from taps.drafter.average import average_command
from taps.propose.spec import (DEFAULTS, GRANULARITIES, MERGE_MODES, SIGNALS, SPEC_HELP, STRATEGIES, VariantSpec,
                               VariantSpecError, parse_member, parse_spec, spec_from_options)


def parse_named_drafter(text: str) -> tuple[str, str]:
    """'NAME=DIR' -> (NAME, DIR); a bare 'DIR' (or a path that itself contains '=') -> (its name, DIR)."""
    try:
        return parse_member(text, f"--drafter {text!r}")
    except VariantSpecError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_spec_argument(text: str) -> VariantSpec:
    """`taps generate --variant SPEC` (no NAME=: generate decodes one variant)."""
    try:
        return parse_spec("generate", text, where=f"--variant {text}")
    except VariantSpecError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _choices(table: dict[str, str]) -> str:
    return ", ".join(f"{name}: {meaning}" for name, meaning in table.items())


def add_strategy_arguments(p) -> None:
    """The composition options of `taps generate` (names and meanings come from propose/spec.py)."""
    p.add_argument("--variant", type=parse_spec_argument, metavar="SPEC",
                   help=f"the whole composition in one word, as taps eval names it: {SPEC_HELP}; instead of "
                        "--drafter and the options below, which build the same SPEC")
    p.add_argument("--strategy", choices=[s for s in STRATEGIES if s != "baseline"], default="single",
                   help="how several --drafter heads are combined (single needs exactly one): "
                        + _choices({s: m for s, m in STRATEGIES.items() if s != "baseline"}))
    p.add_argument("--signal", choices=list(SIGNALS), default=DEFAULTS["signal"], help="route: " + _choices(SIGNALS))
    p.add_argument("--granularity", choices=list(GRANULARITIES), default=DEFAULTS["granularity"],
                   help="route: " + _choices(GRANULARITIES))
    p.add_argument("--merge-mode", choices=list(MERGE_MODES), default=DEFAULTS["merge_mode"],
                   help="merge: " + _choices(MERGE_MODES))
    p.add_argument("--weight", action="append", type=float,
                   help="average: weight of the matching --drafter (repeat; must sum to 1; default equal)")


def strategy_options(args) -> dict:
    """build_proposer keyword arguments from the options above."""
    return {"strategy": args.strategy, "signal": args.signal, "granularity": args.granularity,
            "merge_mode": args.merge_mode, "weights": args.weight}


def composition(args) -> VariantSpec:
    """`taps generate`'s VariantSpec: --variant SPEC, or the one its sugar builds (no --drafter:
    plain decoding)."""
    options = strategy_options(args)
    if args.variant is None:
        return spec_from_options(args.drafter or [], **options)
    if args.drafter or options != {"strategy": "single", **DEFAULTS, "weights": None}:
        raise ValueError("--variant SPEC names the whole composition: give it without --drafter, --strategy, --signal, "
                         "--granularity, --merge-mode and --weight")
    return args.variant


def _lambdas(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lambdas expects comma-separated numbers, got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"--lambdas expects numbers in [0, 1], got {text!r}")
    return values


def register(sub) -> None:
    p = sub.add_parser("average", help="weight-average drafter heads into a new drafter (or a lambda sweep)",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--drafter", action="append", required=True, type=parse_named_drafter, metavar="[NAME=]DIR",
                   help="drafter directory; repeat for each head (at least two)")
    p.add_argument("--weight", action="append", type=float,
                   help="weight of the matching --drafter; repeat once per drafter; must sum to 1 "
                        "(default: equal weights)")
    p.add_argument("--sweep", action="store_true",
                   help="with exactly two drafters A B: write OUT/lambda-<l> = l*A + (1-l)*B for each --lambdas value")
    p.add_argument("--lambdas", type=_lambdas, default=None, help="comma-separated lambdas for --sweep "
                   "(default 0.1,0.2,...,0.9)")
    p.add_argument("--out", required=True, help="output drafter directory (with --sweep: a root directory); never "
                                                "one of the --drafter directories")
    p.add_argument("--force", action="store_true", help="replace drafters already in --out")
    p.set_defaults(func=_average)


def _average(args) -> int:
    print(average_command(args.drafter, args.out, args.weight, args.sweep, args.lambdas, force=args.force))
    return 0
