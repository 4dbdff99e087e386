"""`taps tiny ...`: build the embedded default. Handlers parse arguments and call the recipe."""

from __future__ import annotations

from taps.cli_args import DefaultsHelpFormatter, device_arg, positive_int


def register(sub) -> None:
    p = sub.add_parser("tiny", help="build the embedded tiny chat+math target (and its drafters)")
    tsub = p.add_subparsers(dest="tiny_command", required=True)
    b = tsub.add_parser("build-target", help="train the tiny target from ShareGPT + GSM8K (resumable)",
                        formatter_class=DefaultsHelpFormatter)
    b.add_argument("--data-dir", help="data directory laid out like ../shared/data (default: $TAPS_DATA_DIR)")
    b.add_argument("--out", required=True, help="where the finished model is saved (Hugging Face layout)")
    b.add_argument("--work", help="checkpoints, caches and log (default: OUT.work)")
    b.add_argument("--minutes", type=float, help="wall-clock cap; stops early (and records it) when hit")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--steps", type=positive_int, default=2000)
    b.add_argument("--batch-size", type=positive_int, default=8)
    b.add_argument("--seq-len", type=positive_int, default=512)
    b.add_argument("--pack", choices=["stream", "conversations"], default="stream",
                   help="training blocks at any offset of the packed corpus, or each at a conversation's start "
                        "(every answer then sees its question)")
    b.add_argument("--chat-max-tokens", type=positive_int, default=768, help="cut each chat conversation to this many tokens")
    b.add_argument("--math-share", type=float, default=0.5, help="share of each batch from the math domain")
    b.add_argument("--init-from", help="continue training a target this recipe built (same tokenizer and split; "
                                       "its data blocks are not repeated)")
    b.add_argument("--lr", type=float, default=2e-3)
    b.add_argument("--unlikelihood", type=float, default=0.0,
                   help="weight of token-level unlikelihood against tokens already in the block, which counters "
                        "greedy repetition (Welleck et al. 2019); 0 trains on cross-entropy alone")
    b.add_argument("--seq-unlikelihood", type=float, default=0.0,
                   help="weight of sequence-level unlikelihood: each step the model answers --seq-prompts chat "
                        "questions of its batch greedily and tokens of 4-grams repeated in its answers are pushed "
                        "down (for fine-tuning with --init-from)")
    b.add_argument("--seq-prompts", type=positive_int, default=8)
    b.add_argument("--seq-new-tokens", type=positive_int, default=128)
    b.add_argument("--threads", type=positive_int, help="torch CPU threads")
    b.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda, cuda:N or auto (a GPU when there is one)")
    b.add_argument("--mixed-precision", choices=["no", "bf16"], default="no",
                   help="bf16 autocast (GPUs; CPUs with AMX too: 1.8x measured on the default shape)")
    b.add_argument("--hidden-size", type=positive_int, default=256)
    b.add_argument("--layers", type=positive_int, default=6)
    b.add_argument("--heads", type=positive_int, default=4, help="attention heads (as many key/value heads)")
    b.add_argument("--intermediate-size", type=positive_int, default=704)
    b.add_argument("--chat-source", default="sharegpt", help="source spec of the chat domain")
    b.add_argument("--chat-max-answer-words", type=positive_int,
                   help="drop chat conversations with an assistant turn longer than this (words)")
    b.add_argument("--chat-drop-code", action="store_true",
                   help="drop chat conversations with a code fence in an assistant turn")
    b.add_argument("--math-source", default="gsm8k:train", help="source spec of the math domain")
    b.set_defaults(func=_build_target)

    d = tsub.add_parser("build-drafters", help="train the chat / math / mixed drafters of both backbones (resumable)",
                        formatter_class=DefaultsHelpFormatter)
    d.add_argument("--target", required=True, help="the tiny target directory")
    d.add_argument("--data-dir", help="data directory laid out like ../shared/data (default: $TAPS_DATA_DIR)")
    d.add_argument("--out", required=True, help="drafters directory: one <backbone>-<domain>/ per drafter")
    d.add_argument("--work", help="data, features and checkpoints (default: OUT.work)")
    d.add_argument("--n", type=positive_int, default=2000, help="records per domain (mixed-small: N/2 + N/2, mixed-large: N + N)")
    d.add_argument("--epochs", type=positive_int, default=6)
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--batch-size", type=positive_int, default=8)
    d.add_argument("--max-len", type=positive_int, default=512)
    d.add_argument("--backbones", default="eagle2,hass")
    d.add_argument("--domains", default="chat,math,mixed-small,mixed-large")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--threads", type=positive_int, help="torch CPU threads (per worker with --jobs; default: cores / jobs)")
    d.add_argument("--device", type=device_arg, default="cpu", help="where the target and the heads run: cpu, cuda or auto")
    d.add_argument("--mixed-precision", choices=["no", "bf16"], default="no", help="bf16 autocast for the heads (GPUs; AMX CPUs too)")
    d.add_argument("--compile", action="store_true", help="torch.compile the heads' vocabulary-sized loss terms "
                                                             "(as `taps train --compile`)")
    d.add_argument("--jobs", type=positive_int, default=1, help="train this many heads at once, in separate processes; "
                                                       "each takes the next head, longest first, when it finishes "
                                                       "one (on a CPU: one per core)")
    d.add_argument("--checkpoint-steps", type=positive_int, default=100, help="also checkpoint every N steps (resume point)")
    d.add_argument("--chat-source", default="sharegpt")
    d.add_argument("--math-source", default="gsm8k:train")
    d.set_defaults(func=_build_drafters)

    a = tsub.add_parser("drafter-table", help="acceptance length of every drafter on GSM8K-test and MT-Bench",
                        formatter_class=DefaultsHelpFormatter)
    a.add_argument("--target", required=True, help="target model directory the drafters were trained for")
    a.add_argument("--drafters", required=True, help="directory of <backbone>-<domain>/ drafters")
    a.add_argument("--data-dir", help="data directory laid out like ../shared/data (default: $TAPS_DATA_DIR)")
    a.add_argument("--n", type=positive_int, default=20, help="questions per benchmark")
    a.add_argument("--temperatures", default="0,1", help="comma-separated sampling temperatures")
    a.add_argument("--max-new-tokens", type=positive_int, default=256, help="answer length cap per question")
    a.add_argument("--out", required=True, help="writes OUT.md and OUT.json after each drafter; a rerun measures only new or retrained drafters")
    a.add_argument("--jobs", type=positive_int, default=1, help="measure this many drafters at once, in separate processes "
                                                       "(on a CPU: one per core); the same rows as one process")
    a.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the target's and heads' dtype (bf16: the fast path on AMX CPUs and GPUs)")
    a.set_defaults(func=_drafter_table)

    c = tsub.add_parser("check-target", help="GSM8K-format share and MT-Bench repetition of a target's answers")
    c.add_argument("--target", required=True)
    c.add_argument("--data-dir", help="data directory laid out like ../shared/data (default: $TAPS_DATA_DIR)")
    c.add_argument("--n", type=positive_int, default=20, help="questions per benchmark")
    c.add_argument("--max-new-tokens", type=positive_int, default=256)
    c.add_argument("--samples", help="write every question and answer to this JSONL file")
    c.set_defaults(func=_check_target)


def _build_target(args) -> int:
    from taps.tiny.target_recipe import TargetRecipe, build_target

    recipe = TargetRecipe(data_dir=args.data_dir, chat_source=args.chat_source, math_source=args.math_source,
                          seed=args.seed, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                          pack=args.pack, chat_max_tokens=args.chat_max_tokens,
                          math_share=args.math_share, init_from=args.init_from,
                          lr=args.lr, unlikelihood=args.unlikelihood,
                          seq_unlikelihood=args.seq_unlikelihood, seq_prompts=args.seq_prompts,
                          seq_new_tokens=args.seq_new_tokens, minutes=args.minutes, threads=args.threads, device=args.device,
                          mixed_precision=args.mixed_precision, hidden_size=args.hidden_size, layers=args.layers,
                          heads=args.heads, kv_heads=args.heads, intermediate_size=args.intermediate_size,
                          chat_max_answer_words=args.chat_max_answer_words, chat_drop_code=args.chat_drop_code)
    build_target(recipe, args.out, args.work or f"{args.out.rstrip('/')}.work")
    return 0


def _data_dir(args) -> str:
    import os

    data_dir = args.data_dir or os.environ.get("TAPS_DATA_DIR")
    if not data_dir:
        raise ValueError("no data directory: pass --data-dir or set TAPS_DATA_DIR")
    return data_dir


def _drafter_table(args) -> int:
    from pathlib import Path

    from taps.target import Target
    from taps.eval.drafter_table import to_markdown, update_table

    temps = tuple(float(x) for x in args.temperatures.split(","))
    drafters = {p.name: p for p in sorted(Path(args.drafters).iterdir()) if (p / "model.safetensors").is_file()}
    if not drafters:
        raise FileNotFoundError(f"{args.drafters}: no drafter directories (<name>/model.safetensors)")
    table = update_table(Target.load(args.target, device="cpu", dtype=args.dtype), drafters, _data_dir(args),
                         args.out, args.n, temps, args.max_new_tokens, jobs=args.jobs, target_dir=args.target)
    print(to_markdown(table, temps))
    return 0


def _check_target(args) -> int:
    import json

    from taps.target import Target
    from taps.tiny.target_check import as_dict, check_target

    data_dir = _data_dir(args)
    samples: list = []
    check = check_target(Target.load(args.target, device="cpu", dtype="float32"), data_dir, args.n,
                         args.max_new_tokens, samples)
    if args.samples:
        with open(args.samples, "w") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)
    print(json.dumps(as_dict(check), indent=2))
    return 0


def _build_drafters(args) -> int:
    from taps.train.family import DrafterRecipe, build_drafters

    recipe = DrafterRecipe(data_dir=args.data_dir, chat_source=args.chat_source, math_source=args.math_source,
                           n_per_domain=args.n, max_len=args.max_len, epochs=args.epochs, lr=args.lr,
                           batch_size=args.batch_size, seed=args.seed, threads=args.threads,
                           checkpoint_steps=args.checkpoint_steps, device=args.device,
                           mixed_precision=args.mixed_precision, compile_loss=args.compile,
                           backbones=tuple(args.backbones.split(",")), domains=tuple(args.domains.split(",")))
    build_drafters(recipe, args.target, args.out, args.work or f"{args.out.rstrip('/')}.work", jobs=args.jobs)
    return 0
