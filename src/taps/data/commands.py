"""The `taps data` subcommands: they parse arguments and call `taps.data` functions, nothing more."""

from __future__ import annotations

import argparse

from taps.cli_args import device_arg, positive_int
from taps.data.sources import DATA_DIR_ENV, SPEC_HELP


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `data` command group to the `taps` parser's subparsers."""
    data = subparsers.add_parser("data", help="prepare training data: read, filter and mix sources")
    dsub = data.add_subparsers(dest="data_command", required=True)
    mix = dsub.add_parser("mix", help="draw records from several sources, shuffle them together, write JSONL")
    mix.add_argument("--source", action="append", required=True, metavar="SPEC[:COUNT]",
                     help=f"repeatable; SPEC is {SPEC_HELP}; a trailing :COUNT (digits) draws that many "
                          "records, without it every record is taken")
    mix.add_argument("--seed", type=int, default=42, help="seed of the draws and of the shuffle")
    mix.add_argument("--out", required=True, help="output JSONL file (written atomically)")
    mix.add_argument("--data-dir", help=f"folder laid out like shared/data (default: ${DATA_DIR_ENV})")
    mix.add_argument("--english", action="store_true", help="keep English conversations only (a heuristic)")
    mix.set_defaults(func=_mix)

    regen = dsub.add_parser("regenerate", help="replace every assistant turn with the target's own response "
                                               "(resumable)")
    regen.add_argument("--target", required=True, help="Hugging Face model directory, .gguf file or known name")
    regen.add_argument("--data", required=True, help="records JSONL (e.g. from `taps data mix`)")
    regen.add_argument("--out", required=True, help="output JSONL; a rerun skips the records already in it")
    regen.add_argument("--drafter", help="optional drafter directory: regenerate with lossless speculative decoding")
    regen.add_argument("--max-new-tokens", type=positive_int, default=512)
    regen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    regen.add_argument("--top-p", type=float, default=1.0)
    regen.add_argument("--seed", type=int, default=0)
    regen.add_argument("--batch-size", type=positive_int, default=1,
                       help="answer B records at a time with transformers' generate (left padding; no --drafter); "
                            "an order of magnitude faster on a CPU at B = 32-64")
    regen.add_argument("--max-turns", type=positive_int, help="keep the first K user turns of each conversation")
    regen.add_argument("--max-prompt-tokens", type=positive_int,
                       help="skip records whose first prompt (chat template included) is longer; they are counted")
    regen.add_argument("--device", type=device_arg, default="auto")
    regen.add_argument("--dtype", default="auto")
    regen.set_defaults(func=_regenerate)


def _mix(args: argparse.Namespace) -> int:
    from taps.data.mix import mix_sources
    from taps.jsonl import write_jsonl

    records = mix_sources(args.source, args.seed, data_dir=args.data_dir, english=args.english, on_report=print)
    out = write_jsonl(records, args.out)
    print(f"wrote {len(records):,} records to {out}")
    return 0


def _regenerate(args: argparse.Namespace) -> int:
    from taps.data.regenerate import RegenerateSettings, regenerate
    from taps.target import Target

    target = Target.load(args.target, device=args.device, dtype=args.dtype)
    proposer = None
    if args.drafter:
        from taps.drafter.checkpoint import load_head
        from taps.propose.single import SingleProposer

        proposer = SingleProposer(load_head(args.drafter, target)[0])
    settings = RegenerateSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, seed=args.seed, batch_size=args.batch_size,
                                  max_turns=args.max_turns, max_prompt_tokens=args.max_prompt_tokens)
    written = regenerate(target, args.data, args.out, settings, proposer)
    print(f"regenerated {written:,} records into {args.out}")
    return 0
