"""`taps average`: argument parsing only; the work is in drafter/average.py.

    taps average --drafter math=DIR_A --drafter chat=DIR_B [--weight 0.5 --weight 0.5] --out DIR
    taps average --drafter A --drafter B --sweep [--lambdas 0.1,0.5,0.9] --out ROOT   (ROOT/lambda-<l>)

parse_named_drafter, add_strategy_arguments and strategy_options are for `taps generate`
(several `--drafter NAME=DIR` and `--strategy single|average|route|merge`); the proposer itself is
built by taps.propose.factory.build_proposer(**strategy_options(args), heads=..., tree=...).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from taps.cli_args import DefaultsHelpFormatter


def parse_named_drafter(text: str) -> tuple[str, str]:
    """'NAME=DIR' -> (NAME, DIR); a bare 'DIR' (or a path that itself contains '=') -> (its name, DIR)."""
    name, sep, path = text.partition("=")
    if not sep or Path(text).exists() or not name or "/" in name:
        path = text
        name = Path(text.rstrip("/")).name or text
    if not path:
        raise argparse.ArgumentTypeError(f"--drafter {text!r}: expected NAME=DIR or DIR")
    return name, path


def add_strategy_arguments(p) -> None:
    """The composition options of `taps generate` (choices come from the factory's tables)."""
    from taps.propose.factory import GRANULARITIES, MERGE_MODES, SIGNALS, STRATEGIES

    p.add_argument("--strategy", choices=STRATEGIES, default="single",
                   help="how several --drafter heads are combined (single needs exactly one)")
    p.add_argument("--signal", choices=list(SIGNALS), default="confidence",
                   help="route: mean node confidence (higher wins) or mean draft entropy (lower wins)")
    p.add_argument("--granularity", choices=list(GRANULARITIES), default="step",
                   help="route: decide at every draft/verify step, or once per turn from the first trees")
    p.add_argument("--merge-mode", choices=list(MERGE_MODES), default="disjoint",
                   help="merge: disjoint trees under one root | trie (shared prefixes) | budget (trie reranked "
                        "to the single-tree --total-tokens)")
    p.add_argument("--weight", action="append", type=float,
                   help="average: weight of the matching --drafter (repeat; must sum to 1; default equal)")


def strategy_options(args) -> dict:
    """build_proposer keyword arguments from the options above."""
    return {"strategy": args.strategy, "signal": args.signal, "granularity": args.granularity,
            "merge_mode": args.merge_mode, "weights": args.weight}


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
    p.add_argument("--out", required=True, help="output drafter directory (with --sweep: a root directory)")
    p.set_defaults(func=_average)


def _average(args) -> int:
    from taps.drafter.average import DEFAULT_LAMBDAS, average_checkpoints, sweep_checkpoints

    names = [n for n, _ in args.drafter]
    paths = [d for _, d in args.drafter]
    if len(paths) < 2:
        raise ValueError("taps average needs at least two --drafter")
    if len(set(names)) != len(names):
        raise ValueError(f"--drafter names must be distinct, got {', '.join(names)}; name them NAME=DIR")
    if args.sweep:
        if len(paths) != 2:
            raise ValueError(f"--sweep interpolates exactly two drafters, got {len(paths)}")
        if args.weight:
            raise ValueError("--sweep takes --lambdas, not --weight")
        outs = sweep_checkpoints(paths[0], paths[1], args.out, args.lambdas or DEFAULT_LAMBDAS, names)
        print(f"wrote {len(outs)} averaged drafters lambda*{names[0]} + (1-lambda)*{names[1]} under {args.out}")
        return 0
    if args.lambdas is not None:
        raise ValueError("--lambdas needs --sweep")
    out = average_checkpoints(paths, args.out, args.weight, names)
    weights = args.weight or [1.0 / len(paths)] * len(paths)
    print(f"wrote {' + '.join(f'{w:g}*{n}' for w, n in zip(weights, names))} to {out}")
    return 0
