"""`taps eval`, `taps report` and the study commands (`taps reproduce`, `taps demo`): argument
parsing only; the work is in eval/runner.py, eval/report.py and study.py.

    taps eval --target DIR --variant NAME=SPEC ... --bench mt_bench,gsm8k,math500,svamp \\
              --temperature 0,1 --out DIR [--limit N --max-new-tokens 512 --seed S]
"""

from __future__ import annotations

import argparse
import os

from taps.cli.args import (DTYPES, DefaultsHelpFormatter, add_device_arguments, add_tree_arguments, finite_float,
                           number_list, positive_int, seed_int, speculation_from, target_ref)
from taps.core.config import DEMO_OUT, STUDY_STAGES
from taps.eval.benchmarks import load_questions, parse_bench_list
from taps.eval.report import write_report
from taps.eval.runner import ACCEPTANCE, EvalSettings, eval_benchmarks
from taps.propose.spec import SPEC_HELP, VariantSpecError, parse_variant
from taps.study import DemoSettings, reproduce, run_demo


def _variant(text: str):
    try:
        return parse_variant(text)
    except VariantSpecError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _benches(text: str) -> list[str]:
    try:
        return parse_bench_list(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_decode_arguments(p) -> None:
    """Target, tree and decoding options shared by `taps eval` and the study commands."""
    p.add_argument("--max-new-tokens", type=positive_int, default=512, help="answer length cap per turn")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--top-p", type=finite_float, default=1.0)
    add_tree_arguments(p)
    add_device_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def register(sub) -> None:
    p = sub.add_parser("eval", help="decode benchmarks with every variant; one JSONL record per question and turn",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--target", required=True, help="Hugging Face model directory (safetensors)")
    p.add_argument("--variant", action="append", required=True, type=_variant, metavar="NAME=SPEC",
                   help=f"repeat; SPEC = {SPEC_HELP}")
    p.add_argument("--bench", type=_benches, default="mt_bench,gsm8k,math500,svamp",
                   help="comma-separated benchmark names or paths to FastChat question.jsonl files ([name=]PATH)")
    p.add_argument("--temperature", type=number_list, default="0", help="comma-separated, e.g. 0,1")
    p.add_argument("--out", required=True, help="results directory (records.jsonl, run.json); reruns resume")
    p.add_argument("--data-dir", help="data directory, laid out as docs/spec.md §8 says (default: $TAPS_DATA_DIR)")
    p.add_argument("--limit", type=positive_int, help="first N questions of each benchmark")
    p.add_argument("--category", action="append", help="keep only this category (repeat)")
    p.add_argument("--jobs", type=positive_int, default=1, help="worker processes on this machine, each every N-th question "
                                                       "with its share of the cores (CPUs; for GPUs use "
                                                       "accelerate launch)")
    add_acceptance_argument(p, "verify")
    add_decode_arguments(p)
    p.set_defaults(func=_eval)


def add_acceptance_argument(p, default: str) -> None:
    p.add_argument("--acceptance", choices=list(ACCEPTANCE), default=default,
                   help="verify: every drafted tree verified by the target (acceptance and speed); replay: at "
                        "temperature 0 each tree walked along the target's own greedy answer, decoded once per "
                        "question (the same acceptance in float32, no tree forward, no speed)")


def _eval(args) -> int:
    settings = EvalSettings(temperatures=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed,
                            speculation=speculation_from(args), top_p=args.top_p, acceptance=args.acceptance)
    questions = load_questions(args.bench, args.data_dir, args.limit, args.category)
    print(eval_benchmarks(target_ref(args), args.variant, questions, args.out, settings,
                          args.jobs, progress=not args.no_progress))
    return 0


def register_study(sub) -> None:
    """`taps reproduce CONFIG` and `taps demo`."""
    r = sub.add_parser("reproduce", help="run a whole study from a YAML config: target, drafters, eval, report",
                       formatter_class=DefaultsHelpFormatter)
    r.add_argument("config", help="study config, e.g. configs/smollm2.yaml")
    r.add_argument("--data-dir", help="data directory, laid out as docs/spec.md §8 says (default: the config's, "
                                      "else $TAPS_DATA_DIR)")
    r.add_argument("--stages", default=",".join(STUDY_STAGES), help="comma-separated subset of the stages, in order")
    r.add_argument("--dry-run", action="store_true", help="print what would run (and what is skipped); run nothing")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(func=_reproduce)

    d = sub.add_parser("demo", help="a small study on the embedded default: every variant of each backbone "
                                    "whose math and chat heads ship",
                       formatter_class=DefaultsHelpFormatter)
    d.add_argument("--models", default="models/smollm2-135m-instruct",
                   help="the embedded default: drafters/ (and target/, unless the directory is named after a "
                        "known target)")
    d.add_argument("--data-dir", help="data directory, laid out as docs/spec.md §8 says (default: $TAPS_DATA_DIR, "
                                      "else the Hugging Face hub)")
    d.add_argument("--out", default=DEMO_OUT, help="results/ and report/ go here; a rerun resumes (in the default "
                                                   "directory, results of an earlier embedded default are moved aside)")
    d.add_argument("--per-bench", type=positive_int, default=1,
                   help="questions per benchmark (default 1: every variant in ~3 min on 2 cores, replayed)")
    d.add_argument("--max-new-tokens", type=positive_int, default=96, help="answer length cap per turn")
    add_tree_arguments(d)  # the paper's 60/5/10; a CPU verifies a smaller tree faster (or --tree auto)
    d.add_argument("--dtype", default="auto", choices=DTYPES, help="the target's and heads' dtype (auto: bf16 on "
                                                                   "GPUs; on a CPU the faster, measured)")
    d.add_argument("--jobs", type=positive_int, default=demo_jobs(),
                   help="worker processes, one thread each (default: one per usable core, at most 4: on a CPU that "
                        "decodes fastest)")
    add_acceptance_argument(d, DemoSettings.acceptance)  # replay: Table 1 without verifying a tree
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=_demo)


def demo_jobs() -> int:
    """One worker per core this process may use, at most 4 (the demo has 8 questions per variant)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _reproduce(args) -> int:
    reproduce(args.config, args.stages, args.data_dir, args.dry_run, progress=not args.no_progress)
    return 0


def _demo(args) -> int:
    settings = DemoSettings(args.per_bench, args.max_new_tokens, speculation_from(args), args.dtype, args.jobs,
                            args.acceptance)
    run_demo(args.models, args.out, args.data_dir, settings, progress=not args.no_progress)
    return 0


def register_report(sub) -> None:
    p = sub.add_parser("report", help="tables (md, csv, tex) and figures from a `taps eval` results directory")
    p.add_argument("results_dir", metavar="RESULTS_DIR", help="a `taps eval --out` directory (run.json, records)")
    p.add_argument("--out", required=True, help="report directory (report.md, tables, figures)")
    p.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    print(write_report(args.results_dir, args.out))
    return 0
