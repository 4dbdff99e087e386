"""`taps features` and `taps train`: argument parsing only; the work is in data/features.py and
train/trainer.py. Their settings' options come from the settings dataclasses (FeatureSettings,
TrainConfig: config.setting fields)."""

from __future__ import annotations

from taps.cli.args import DefaultsHelpFormatter, add_settings, device_arg, settings_from, target_ref
from taps.data.features import FeatureSettings, features_of
from taps.train.trainer import TrainConfig, train_drafter


def register(sub) -> None:
    f = sub.add_parser("features", help="target features (hidden states + assistant masks) for drafter training",
                       formatter_class=DefaultsHelpFormatter)
    f.add_argument("--target", required=True, help="Hugging Face model directory")
    f.add_argument("--data", required=True, help="records JSONL (e.g. from `taps data mix`)")
    f.add_argument("--out", required=True, help="features directory (resumed if it exists)")
    add_settings(f, FeatureSettings)
    f.add_argument("--device", type=device_arg, default="auto")
    f.add_argument("--target-dtype", default="auto", help="dtype the target runs in")
    f.set_defaults(func=_features)

    t = sub.add_parser("train", help="train an EAGLE-2, HASS or EAGLE-3 drafter on features "
                                     "(runs under accelerate launch)",
                       formatter_class=DefaultsHelpFormatter)
    t.add_argument("--target", required=True)
    t.add_argument("--features", required=True, action="append", metavar="DIR[:LIMIT]",
                   help="features directory; repeat to train on several (DIR:LIMIT takes its first LIMIT records)")
    t.add_argument("--out", required=True, help="drafter directory; checkpoints go to OUT/ckpt")
    add_settings(t, TrainConfig)
    t.add_argument("--resume", action="store_true", help="continue from OUT/ckpt (without one: start, and say so)")
    t.add_argument("--force", action="store_true", help="replace a drafter already in --out that has no training run "
                                                        "(e.g. one of drafter init)")
    t.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")
    t.set_defaults(func=_train)


def _features(args) -> int:
    print(features_of(target_ref(args, dtype=args.target_dtype), args.data, args.out,
                      settings_from(FeatureSettings, args)))
    return 0


def _train(args) -> int:
    train_drafter(args.target, args.features, args.out, settings_from(TrainConfig, args), resume=args.resume,
                  device="cpu" if args.cpu else None, force=args.force)
    return 0
