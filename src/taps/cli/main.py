"""The `taps` command: every subcommand is registered here (those of a layer through its
`commands.register`), and each handler is one call into a library function.

Imports sit at module top: `taps --help` loads the library with them (torch and transformers;
optional packages, such as accelerate for training, load only when a command needs them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from safetensors import SafetensorError

from taps.cli.args import (DefaultsHelpFormatter, add_attn_argument, add_device_arguments, add_tree_arguments,
                           comma_list, finite_float, non_negative_float, number_list, positive_int, seed_int,
                           speculation_from, target_ref)
from taps.core.config import DecodeConfig, SamplingConfig
from taps.cli import data as data_commands
from taps.core.decode import ContextWindowError
from taps.cli import drafter as drafter_commands
from taps.drafter.checkpoint import CheckpointError, write_untrained
from taps.cli import eval as eval_commands
from taps.eval.drafter_table import table_of_directory
from taps.core.outlock import OutputBusyError
from taps.drafter.profile import profile_report
from taps.cli import propose as propose_commands
from taps.propose.generate import generate_prompt
from taps.cli import serve as serve_commands
from taps.core.targets import convert_target
from taps.cli import train as train_commands
from taps.train.draft_vocab import reduce_vocab
from taps.train.trainer import TrainingError

# a user's mistake, not a bug: one line and exit code 2 (main)
USER_ERRORS = (CheckpointError, ContextWindowError, TrainingError, OutputBusyError, OSError, ValueError,
               SafetensorError)


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids expects comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="decode a prompt, speculatively with --drafter or plainly without")
    p.add_argument("--target", required=True, help="Hugging Face model directory (safetensors)")
    p.add_argument("--drafter", action="append", type=propose_commands.parse_named_drafter, metavar="[NAME=]DIR",
                   help="drafter directory (EAGLE layout), or `lookup` (prompt lookup, model-free), `lookup+STORE` "
                        "(prompt lookup, then the datastore STORE of `taps lookup build`) or a datastore "
                        "directory (the datastore alone); repeat to combine several with --strategy; omit "
                        "(and --variant) for plain decoding")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (rendered through the chat template unless --raw)")
    src.add_argument("--prompt-ids", type=_ids, help="comma-separated token ids, used as they are")
    p.add_argument("--raw", action="store_true", help="tokenize --prompt as plain text, no chat template")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=finite_float, default=1.0)
    p.add_argument("--sample-top-k", type=int, default=0, help="top-k filter of the target's sampling distribution")
    p.add_argument("--seed", type=seed_int, default=0)
    add_tree_arguments(p)
    add_device_arguments(p)
    add_attn_argument(p)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    propose_commands.add_strategy_arguments(p)
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    spec = propose_commands.composition(args)
    out = generate_prompt(target_ref(args), spec, args.prompt if args.prompt_ids is None else args.prompt_ids,
                          raw=args.raw, speculation=speculation_from(args),
                          decode=DecodeConfig(args.max_new_tokens, seed=args.seed,
                                              sampling=SamplingConfig(args.temperature, args.top_p, args.sample_top_k)))
    if args.json:
        print(json.dumps(out.as_json()))
    else:
        print(out.text)
        print(out.summary(), file=sys.stderr)
    return 0


def _add_drafter(sub) -> None:
    p = sub.add_parser("drafter", help="drafter checkpoints")
    dsub = p.add_subparsers(dest="drafter_command", required=True)
    init = dsub.add_parser("init", help="write an untrained EAGLE head sized for a target")
    init.add_argument("--target", required=True, help="Hugging Face model directory")
    init.add_argument("--out", required=True, help="output drafter directory")
    init.add_argument("--seed", type=seed_int, default=0)
    init.add_argument("--fc-bias", action="store_true", help="build fc with a bias")
    init.add_argument("--backbone", choices=("eagle2", "eagle3"), default="eagle2",
                      help="an EAGLE-2 / HASS head, or an EAGLE-3 head (full draft vocabulary, the default layers)")
    init.add_argument("--force", action="store_true", help="replace a drafter already in --out")
    init.set_defaults(func=_drafter_init)
    reduce = dsub.add_parser("reduce-vocab", help="copy a drafter with a draft vocabulary: the N most frequent "
                                                  "target tokens of training features (EAGLE-3 / SGLang d2t, t2d)")
    reduce.add_argument("--drafter", required=True, help="drafter directory to copy (weights unchanged)")
    reduce.add_argument("--features", required=True, type=comma_list, metavar="DIR[,DIR...]",
                        help="features directories whose assistant tokens are counted (DIR:LIMIT: first LIMIT records)")
    reduce.add_argument("--size", required=True, type=int, metavar="N", help="draft vocabulary size, 1..V")
    reduce.add_argument("--out", required=True, help="output drafter directory (not --drafter itself)")
    reduce.add_argument("--force", action="store_true", help="replace a drafter already in --out")
    reduce.set_defaults(func=_drafter_reduce_vocab)
    table = dsub.add_parser("table", help="acceptance length of every drafter of a directory on GSM8K-test and "
                                          "MT-Bench first turns (a model card's table)",
                            formatter_class=DefaultsHelpFormatter)
    table.add_argument("--target", required=True, help="the target the drafters were trained for")
    table.add_argument("--drafters", required=True, help="directory of drafter directories (<name>/model.safetensors)")
    table.add_argument("--data-dir", help="data directory, laid out as docs/spec.md §8 says (default: $TAPS_DATA_DIR, "
                                          "else the Hugging Face hub)")
    table.add_argument("--n", type=positive_int, default=20, help="questions per benchmark")
    table.add_argument("--temperatures", type=number_list, default="0,1", metavar="T[,T...]",
                       help="comma-separated sampling temperatures")
    table.add_argument("--max-new-tokens", type=positive_int, default=256, help="answer length cap per question")
    table.add_argument("--out", required=True, help="writes OUT.md and OUT.json after each drafter; a rerun "
                                                    "measures only new or retrained drafters")
    table.add_argument("--jobs", type=positive_int, default=1, help="measure this many drafters at once, in separate "
                                                          "processes (on a CPU: one per core); the same rows")
    table.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                       help="the target's and heads' dtype (bf16: the fast path on GPUs and most recent CPUs)")
    table.set_defaults(func=_drafter_table)


def _drafter_table(args) -> int:
    print(table_of_directory(target_ref(args, device="cpu"), args.drafters, args.out, args.data_dir, args.n,
                             args.temperatures, args.max_new_tokens, args.jobs))
    return 0


def _drafter_init(args) -> int:
    out = write_untrained(args.target, args.out, seed=args.seed, bias=args.fc_bias, backbone=args.backbone,
                          force=args.force)
    print(f"wrote an untrained drafter for {args.target} to {out}")
    return 0


def _drafter_reduce_vocab(args) -> int:
    out, vocab = reduce_vocab(args.drafter, args.features, args.size, args.out, force=args.force)
    print(f"wrote {out}: a draft vocabulary of {args.size} tokens covers {vocab.coverage:.2%} of "
          f"{vocab.counted:,} assistant tokens")
    return 0


def _add_target(sub) -> None:
    p = sub.add_parser("target", help="target models: convert a GGUF file to a plain safetensors directory")
    tsub = p.add_subparsers(dest="target_command", required=True)
    conv = tsub.add_parser("convert", help="write a safetensors model directory (config, weights, tokenizer, "
                                           "chat template, generation config) from a GGUF target")
    conv.add_argument("source", metavar="SRC", help="a .gguf file, a directory holding one, or a known name "
                                                    "(smollm2-135m-instruct)")
    conv.add_argument("--out", required=True, help="output directory (new or empty)")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="dtype of the saved weights (float32 keeps the dequantised values exactly)")
    conv.set_defaults(func=_target_convert)


def _target_convert(args) -> int:
    out, gguf = convert_target(args.source, args.out, args.dtype)
    print(f"wrote {out} ({args.dtype}) from {gguf}")
    return 0


def _add_profile(sub) -> None:
    p = sub.add_parser("profile", help="measure this machine's costs: the target's tree forward per node count, "
                                       "a draft level per beam count (cached)")
    p.add_argument("--target", required=True, help="model directory, .gguf file or known name")
    p.add_argument("--drafter", help="drafter directory: also time its draft levels")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; each figure is their median")
    p.add_argument("--measure", action="store_true", help="measure again even if a cached profile exists")
    add_device_arguments(p)
    p.set_defaults(func=_profile)


def _profile(args) -> int:
    print(profile_report(target_ref(args), args.drafter, args.threads, args.repeats, args.measure))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake reported in one line (no usage block) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="taps", description="Task-aware speculative decoding.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of any error (also TAPS_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_drafter(sub)
    _add_target(sub)
    _add_profile(sub)
    data_commands.register(sub)
    data_commands.register_lookup(sub)
    propose_commands.register(sub)
    train_commands.register(sub)
    eval_commands.register(sub)
    eval_commands.register_study(sub)
    eval_commands.register_report(sub)
    serve_commands.register(sub)
    drafter_commands.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user's mistake (a missing, unreadable or corrupt file, a bad option value,
    an unusable output path, a resume of another run, a busy output) exits with code 2 and one
    line naming the culprit; anything else is a bug and keeps its traceback. With --debug or
    TAPS_DEBUG=1 every error shows its traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8 reach Python as lone surrogates
            print(f"taps: error: the argument {arg.encode('utf-8', 'replace').decode()!r} is not UTF-8 text",
                  file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("TAPS_DEBUG", "") not in ("", "0")
    try:
        return args.func(args)
    except USER_ERRORS as err:
        if debug:
            raise
        print(f"taps {args.command}: error: {user_message(err)}", file=sys.stderr)
        return 2


def user_message(err: BaseException) -> str:
    """One line: an OSError names its file and what went wrong; the others carry their own message."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        text = f"{err.filename}: {err.strerror}"
        if isinstance(err, (FileExistsError, NotADirectoryError)):
            text += " (expected a directory, or a path that does not exist yet)"
        elif isinstance(err, PermissionError):
            text += " (expected a path this user can write)"
    else:
        text = str(err) if not isinstance(err, SafetensorError) else f"corrupt safetensors file ({err})"
    return " ".join(text.split()) or type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
