"""The `taps data` subcommands, and `taps lookup build` (the lookup drafter's datastore, built from
data): they parse arguments and call `taps.data` functions, nothing more."""

from __future__ import annotations

import argparse

from taps.cli.args import add_settings, comma_list, device_arg, positive_int, seed_int, settings_from, target_ref
from taps.data.datastore import build_datastore
from taps.data.mix import mix_to_file
from taps.data.regenerate import RegenerateSettings, regenerate_file
from taps.data.regenerate_http import EndpointSettings
from taps.data.sources import DATA_DIR_ENV, SPEC_HELP
from taps.propose.rest import INDEX_DEPTH


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `data` command group to the `taps` parser's subparsers."""
    data = subparsers.add_parser("data", help="prepare training data: read, filter and mix sources")
    dsub = data.add_subparsers(dest="data_command", required=True)
    mix = dsub.add_parser("mix", help="draw records from several sources, shuffle them together, write JSONL")
    mix.add_argument("--source", action="append", required=True, metavar="SPEC[:COUNT]",
                     help=f"repeatable; SPEC is {SPEC_HELP}; a trailing :COUNT (digits) draws that many "
                          "records, without it every record is taken")
    mix.add_argument("--seed", type=seed_int, default=42, help="seed of the draws and of the shuffle")
    mix.add_argument("--out", required=True, help="output JSONL file (written atomically; never one of the "
                                                  "sources)")
    mix.add_argument("--force", action="store_true", help="replace an existing --out mixture")
    mix.add_argument("--data-dir", help=f"data directory, laid out as docs/spec.md §8 says (default: ${DATA_DIR_ENV})")
    mix.add_argument("--english", action="store_true", help="keep English conversations only (a heuristic)")
    mix.add_argument("--max-prompt-chars", type=positive_int, metavar="N",
                     help="after the draw, drop records whose first user turn is longer than N characters "
                          "(counted; the draw itself does not move)")
    mix.set_defaults(func=_mix)

    regen = dsub.add_parser("regenerate", help="replace every assistant turn with the target's own response "
                                               "(resumable)")
    where = regen.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="Hugging Face model directory, .gguf file or known name")
    where.add_argument("--endpoint", metavar="URL",
                       help="decode on an OpenAI-compatible server that serves the target instead (vLLM, SGLang, "
                            "taps serve), e.g. http://127.0.0.1:8000/v1 (/v1 is added when missing)")
    regen.add_argument("--data", required=True, help="records JSONL (e.g. from `taps data mix`)")
    regen.add_argument("--out", required=True, help="output JSONL; a rerun skips the records already in it")
    regen.add_argument("--drafter", help="optional drafter directory: regenerate with lossless speculative decoding")
    add_settings(regen, RegenerateSettings)
    add_settings(regen, EndpointSettings)
    regen.add_argument("--device", type=device_arg, default="auto")
    regen.add_argument("--dtype", default="auto")
    regen.set_defaults(func=_regenerate)


def _mix(args: argparse.Namespace) -> int:
    print(mix_to_file(args.source, args.seed, args.out, data_dir=args.data_dir, english=args.english, on_report=print,
                      force=args.force, max_prompt_chars=args.max_prompt_chars))
    return 0


def _regenerate(args: argparse.Namespace) -> int:
    target = target_ref(args) if args.target is not None else None
    print(regenerate_file(target, args.data, args.out, settings_from(RegenerateSettings, args), args.drafter,
                          endpoint=args.endpoint, via=settings_from(EndpointSettings, args)))
    return 0


def register_lookup(subparsers: argparse._SubParsersAction) -> None:
    """Add `taps lookup build`: the datastore that `lookup+STORE` drafts from (propose/rest.py)."""
    lookup = subparsers.add_parser("lookup", help="the lookup drafter's datastore: the target's own answers, "
                                                  "retrieved as drafts (REST)")
    lsub = lookup.add_subparsers(dest="lookup_command", required=True)
    build = lsub.add_parser("build", help="tokenize the assistant turns of chat records (e.g. `taps data regenerate` "
                                          "output) into a datastore directory; use it as `--variant lookup+DIR`")
    build.add_argument("--records", required=True, type=comma_list, metavar="FILE[,FILE...]",
                       help="JSONL files of {\"conversations\": [{role, content}, ...]} records")
    build.add_argument("--target", required=True, help="the target whose tokenizer and chat template render the "
                                                       "answers (model directory, .gguf file or known name)")
    build.add_argument("--out", required=True, help="datastore directory (new or empty)")
    build.add_argument("--force", action="store_true", help="rebuild a datastore already in --out")
    build.add_argument("--index-depth", type=int, default=INDEX_DEPTH,
                       help="the longest n-gram the index matches (its sort depth)")
    build.set_defaults(func=_lookup_build)


def _lookup_build(args: argparse.Namespace) -> int:
    print(build_datastore(args.records, args.target, args.out, args.index_depth, force=args.force))
    return 0
