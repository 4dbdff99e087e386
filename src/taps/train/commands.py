"""`taps features` and `taps train`: argument parsing only; the work is in data/features.py and
train/trainer.py."""

from __future__ import annotations

from taps.cli_args import DefaultsHelpFormatter, device_arg, positive_int


def register(sub) -> None:
    f = sub.add_parser("features", help="target features (hidden states + assistant masks) for drafter training",
                       formatter_class=DefaultsHelpFormatter)
    f.add_argument("--target", required=True, help="Hugging Face model directory")
    f.add_argument("--data", required=True, help="records JSONL (e.g. from `taps data mix`)")
    f.add_argument("--out", required=True, help="features directory (resumed if it exists)")
    f.add_argument("--max-len", type=positive_int, default=2048)
    f.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="stored feature dtype")
    f.add_argument("--records-per-shard", type=positive_int, default=512)
    f.add_argument("--tokens-per-batch", type=positive_int, default=8192, help="padded tokens per target forward")
    f.add_argument("--device", type=device_arg, default="auto")
    f.add_argument("--target-dtype", default="auto", help="dtype the target runs in")
    f.set_defaults(func=_features)

    t = sub.add_parser("train", help="train an EAGLE-2 or HASS drafter on features (runs under accelerate launch)",
                       formatter_class=DefaultsHelpFormatter)
    t.add_argument("--backbone", choices=["eagle2", "hass"], default="eagle2")
    t.add_argument("--target", required=True)
    t.add_argument("--features", required=True, action="append", metavar="DIR[:LIMIT]",
                   help="features directory; repeat to train on several (DIR:LIMIT takes its first LIMIT records)")
    t.add_argument("--out", required=True, help="drafter directory; checkpoints go to OUT/ckpt")
    t.add_argument("--epochs", type=positive_int, default=20)
    t.add_argument("--lr", type=float, default=3e-5)
    t.add_argument("--batch-size", type=positive_int, default=8, help="per process")
    t.add_argument("--grad-accum", type=positive_int, default=1)
    t.add_argument("--warmup-steps", type=int, default=2000)
    t.add_argument("--max-len", type=positive_int, help="cut samples to this many tokens")
    t.add_argument("--hass-topk", type=positive_int, default=10)
    t.add_argument("--hass-steps", type=positive_int, default=3)
    t.add_argument("--noise-width", type=float, default=0.2)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--checkpoint-steps", type=positive_int, help="also checkpoint every N steps (always every epoch)")
    t.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    t.add_argument("--compile", action="store_true",
                   help="torch.compile the vocabulary-sized loss terms into fused kernels (same loss; faster "
                        "steps after a one-off compile; needs a C++ compiler on the CPU)")
    t.add_argument("--draft-vocab", type=positive_int, metavar="N",
                   help="draft over the N most frequent target tokens of the training data (EAGLE-3's reduced "
                        "vocabulary; the target's stop tokens always included): [.., N] instead of [.., V] LM-head "
                        "terms; default: the full vocabulary")
    t.add_argument("--training-data", default="", help="a label recorded in the drafter's config")
    t.add_argument("--resume", action="store_true", help="continue from OUT/ckpt")
    t.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")
    t.set_defaults(func=_train)


def _features(args) -> int:
    from taps.data.features import FeatureSettings, extract_features
    from taps.target import Target

    target = Target.load(args.target, device=args.device, dtype=args.target_dtype)
    settings = FeatureSettings(max_len=args.max_len, dtype=args.dtype, records_per_shard=args.records_per_shard,
                               tokens_per_batch=args.tokens_per_batch)
    manifest = extract_features(target, args.data, args.out, settings)
    print(f"features: {manifest['records_done']} records, {manifest['tokens']:,} tokens "
          f"({manifest['assistant_tokens']:,} assistant), {manifest['truncated_records']} truncated, in {args.out}")
    return 0


def _train(args) -> int:
    from taps.train.trainer import TrainConfig, train_drafter

    cfg = TrainConfig(backbone=args.backbone, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                      grad_accum=args.grad_accum, warmup_steps=args.warmup_steps, max_len=args.max_len,
                      hass_topk=args.hass_topk, hass_steps=args.hass_steps, noise_width=args.noise_width,
                      seed=args.seed, checkpoint_steps=args.checkpoint_steps, mixed_precision=args.mixed_precision,
                      compile_loss=args.compile, training_data=args.training_data, draft_vocab=args.draft_vocab)
    from accelerate import PartialState

    out = train_drafter(args.target, args.features, args.out, cfg, resume=args.resume,
                        device="cpu" if args.cpu else None)
    if PartialState().is_main_process:
        print(f"drafter saved to {out}")
    return 0
