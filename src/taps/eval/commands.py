"""`taps eval` (and the study commands): argument parsing only; the work is in eval/*.py.

    taps eval --target DIR --variant NAME=SPEC ... --bench mt_bench,gsm8k,math500,svamp \\
              --temperature 0,1 --out DIR [--limit N --max-new-tokens 512 --seed S]
"""

from __future__ import annotations

import argparse

from taps.propose.spec import SPEC_HELP, VariantSpecError, parse_variant
from taps.cli_args import (DTYPES, DefaultsHelpFormatter, add_device_arguments, add_tree_arguments, positive_int,
                           tree_shape)


def _temperatures(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--temperature expects comma-separated numbers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"--temperature expects numbers >= 0, got {text!r}")
    return values


def _variant(text: str):
    try:
        return parse_variant(text)
    except VariantSpecError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_decode_arguments(p) -> None:
    """Target, tree and decoding options shared by `taps eval` and the study commands."""
    p.add_argument("--max-new-tokens", type=positive_int, default=512, help="answer length cap per turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    add_tree_arguments(p, auto=True)
    add_device_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def register(sub) -> None:
    p = sub.add_parser("eval", help="decode benchmarks with every variant; one JSONL record per question and turn",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--target", required=True, help="Hugging Face model directory (safetensors)")
    p.add_argument("--variant", action="append", required=True, type=_variant, metavar="NAME=SPEC",
                   help=f"repeat; SPEC = {SPEC_HELP}")
    p.add_argument("--bench", default="mt_bench,gsm8k,math500,svamp",
                   help="comma-separated benchmark names or paths to FastChat question.jsonl files ([name=]PATH)")
    p.add_argument("--temperature", type=_temperatures, default=(0.0,), help="comma-separated, e.g. 0,1")
    p.add_argument("--out", required=True, help="results directory (records.jsonl, run.json); reruns resume")
    p.add_argument("--data-dir", help="data directory laid out like ../shared/data (default: $TAPS_DATA_DIR)")
    p.add_argument("--limit", type=positive_int, help="first N questions of each benchmark")
    p.add_argument("--category", action="append", help="keep only this category (repeat)")
    p.add_argument("--jobs", type=positive_int, default=1, help="worker processes on this machine, each every N-th question "
                                                       "with its share of the cores (CPUs; for GPUs use "
                                                       "accelerate launch)")
    add_decode_arguments(p)
    p.set_defaults(func=_eval)


def settings_from(args):
    from taps.config import TreeConfig
    from taps.eval.runner import EvalSettings

    return EvalSettings(temperatures=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed,
                        tree=TreeConfig(*tree_shape(args)), top_p=args.top_p, auto_tree=args.tree == "auto")


def _eval(args) -> int:
    from taps.eval.benchmarks import load_benchmark, parse_bench_list
    from taps.eval.runner import load_target_for_eval, run_eval

    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    questions = [q for name in parse_bench_list(args.bench)
                 for q in load_benchmark(name, args.data_dir, limit=args.limit, categories=args.category)]
    if args.jobs > 1:
        from taps.eval.runner import run_eval_jobs

        total = run_eval_jobs(args.target, args.device, args.dtype, args.variant, questions, args.out,
                              settings_from(args), jobs=args.jobs, progress=not args.no_progress)
        print(f"taps eval: {total} conversations in {args.out} ({args.jobs} worker processes)")
        return 0
    target = load_target_for_eval(args.target, args.device, args.dtype)
    written = run_eval(target, args.target, args.variant, questions, args.out, settings_from(args),
                       progress=not args.no_progress)
    print(f"taps eval: {written} conversations decoded in this run; results in {args.out}")
    return 0


def register_study(sub) -> None:
    """`taps reproduce CONFIG` and `taps demo`."""
    r = sub.add_parser("reproduce", help="run a whole study from a YAML config: target, drafters, eval, report",
                       formatter_class=DefaultsHelpFormatter)
    r.add_argument("config", help="study config, e.g. configs/smollm2.yaml")
    r.add_argument("--data-dir", help="data directory laid out like ../shared/data (default: the config's, "
                                      "else $TAPS_DATA_DIR)")
    r.add_argument("--stages", default=",".join(_stages()), help="comma-separated subset of the stages, in order")
    r.add_argument("--dry-run", action="store_true", help="print what would run (and what is skipped); run nothing")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(func=_reproduce)

    d = sub.add_parser("demo", help="a small study on the embedded default: every variant of both backbones",
                       formatter_class=DefaultsHelpFormatter)
    d.add_argument("--models", default="models/smollm2-135m-instruct",
                   help="the embedded default: drafters/ (and target/, unless the directory is named after a "
                        "known target)")
    d.add_argument("--data-dir", help="data directory laid out like ../shared/data (default: $TAPS_DATA_DIR, "
                                      "else the Hugging Face hub)")
    d.add_argument("--out", default=DEMO_OUT, help="results/ and report/ go here; a rerun resumes (in the default "
                                                   "directory, results of an earlier embedded default are moved aside)")
    d.add_argument("--per-bench", type=positive_int, default=2, help="questions per benchmark")
    d.add_argument("--max-new-tokens", type=positive_int, default=96, help="answer length cap per turn")
    add_tree_arguments(d, auto=True)  # the paper's 60/5/10; a CPU verifies a smaller tree faster (or --tree auto)
    d.add_argument("--dtype", default="auto", choices=DTYPES, help="the target's and heads' dtype (auto: bf16 on "
                                                                   "GPUs and AMX CPUs, else fp32)")
    d.add_argument("--jobs", type=positive_int, default=1, help="worker processes (on a CPU: one per core decodes fastest)")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=_demo)


DEMO_OUT = "runs/demo-study"
# what changes when a new embedded default ships (target or drafter weights); other mismatches
# (tree, settings, variants) are the user's choices and keep the usual refusal
NEW_DEFAULT_KEYS = ("target_fingerprint", "target_weights", "drafter_weights")


def _stages() -> tuple[str, ...]:
    from taps.study import STAGES

    return STAGES


def _reproduce(args) -> int:
    from taps.study import STAGES, load_study, plan, run_study

    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        raise ValueError(f"--stages {args.stages!r}: unknown stage(s) {', '.join(unknown) or '(none given)'}; "
                         f"expected a comma-separated subset of {', '.join(STAGES)}")
    study = load_study(args.config, args.data_dir)
    print("\n".join(plan(study, stages)))
    if args.dry_run:
        return 0
    report = run_study(study, stages, progress=not args.no_progress)
    print(f"taps reproduce: report in {report / 'report.md'}")
    return 0


def _demo(args) -> int:
    import os
    import time
    from pathlib import Path

    from taps.eval.report import terminal_summary
    from taps.eval.runner import ResultsMismatchError
    from taps.study import demo_study, run_study

    total_tokens, depth, top_k = tree_shape(args)
    tree = {"total_tokens": total_tokens, "depth": depth, "top_k": top_k,
            **({"mode": "auto"} if args.tree == "auto" else {})}
    study = demo_study(args.models, args.out, args.data_dir, args.per_bench, args.max_new_tokens, tree=tree,
                       dtype=args.dtype, jobs=args.jobs)
    print(f"taps demo: {len(study.variants)} variants x {', '.join(study.benches)} ({args.per_bench} questions "
          f"each, temperature 0, tree {args.tree} {total_tokens}/{depth}/{top_k}) on {study.target}")
    try:
        report = run_study(study, ("eval", "report"), progress=not args.no_progress)
    except ResultsMismatchError as e:
        # `make demo` after a new embedded default shipped: one command should still just work, and
        # the earlier results are kept, not deleted or mixed in
        if args.out != DEMO_OUT or e.key not in NEW_DEFAULT_KEYS:
            raise
        aside = Path(f"{args.out}.previous-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(args.out, aside)
        print(f"taps demo: {args.out} holds results of another embedded default ({e.key} differs); "
              f"moved them to {aside}, starting afresh")
        report = run_study(study, ("eval", "report"), progress=not args.no_progress)
    print(terminal_summary(study.results))
    print(f"\nfull report: {report / 'report.md'}")
    return 0
