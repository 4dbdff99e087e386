"""`taps adapt DIR --head NAME`: fine-tune the head a `taps serve --learn DIR` serves as NAME on
the answers it logged, and publish the result as the next version only if it drafts better.

Why from the log: every logged answer is the target's own output for a real request, exactly what
an EAGLE head learns to imitate, so no regeneration is needed.

The steps, each kept in DIR/adapt/NAME/vK/ (K: the version it would become) so that a killed run
resumes where it stopped:
  1. plan.json: the split, written once: the log's answers but the `holdout` most recent go to
     train.jsonl, the most recent to heldout.jsonl (a rerun uses the same split, whatever the log
     has gained since), and the version fine-tuned (the newest of DIR/heads/NAME/ not rolled back,
     else --base: the --drafter directory the server was started with, version 0).
  2. features/: the target's features of train.jsonl (data/features.py, resumable), plus any
     --mix FEATURES[:N] of the head's original data, against forgetting.
  3. train/: the fine-tune (train/trainer.py, started from the old head, resumable from its
     checkpoints).
  4. eval.json: the acceptance length (generated tokens / verifier calls, greedy, float32) of the
     old and the new head on the held-out requests' prompts, each decoding as many tokens as the
     logged answer had (at most `max_new_tokens`): the head alone, or with `--judge merge` as a
     --learn server serves it, merged with the lookup member over a datastore of the training
     answers (judge-store/; not DIR/store, which holds the held-out answers too).
  5. DIR/heads/NAME/vK/ (config.json + model.safetensors, moved into place by one rename) only
     if the new head's acceptance is higher. Older versions stay: a rollback is deleting vK, or a
     `rolled_back.json` in it (serve/swap.py).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from taps.core.config import DecodeConfig, TreeConfig, check_at_least, setting
from taps.data.features import FeatureSettings, extract_features
from taps.core.decode import chat_ids, generate
from taps.drafter.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_head
from taps.drafter.head import EagleHead
from taps.core.jsonl import read_json, read_json_lines, write_json_atomic, write_jsonl
from taps.data.chat import special_ids
from taps.propose.factory import HeadPool
from taps.propose.rest import is_datastore, write_datastore
from taps.propose.single import SingleProposer
from taps.propose.spec import variant_from_config
from taps.serve.adapt_focus import FOCUS, focus_features
from taps.serve.answer_log import read_log
from taps.serve.online_store import answer_segment
from taps.serve.swap import HEADS_DIR, ROLLED_BACK, head_versions
from taps.core.target import TargetRef
from taps.train.trainer import Trainer, TrainConfig

ADAPT_DIR = "adapt"
JUDGES = ("head", "merge")


class AdaptError(ValueError):
    """Bad input to `taps adapt`; the message names the option or file."""


@dataclass(frozen=True)
class AdaptSettings:
    # `taps adapt`'s options (cli/args.add_settings)
    holdout: int = setting(20, "the most recent logged answers held out to compare the old and new head", at_least=1)
    epochs: int = setting(4, at_least=1)
    lr: float = setting(1e-4, "fine-tuning learning rate (linear decay to 0, no warm-up)")
    batch_size: int = setting(4, at_least=1)
    max_len: int = setting(1024, "cut each record to this many tokens", at_least=1)
    max_new_tokens: int = setting(256, "held-out evaluation: the most tokens decoded per prompt", at_least=1)
    judge: str = setting("head", "what the held-out acceptance measures: the head alone, or merge: merged with the "
                                 "lookup member over a datastore of the training answers, as a --learn server serves "
                                 "it (merge-budget:HEAD,lookup, the fixed tree)", choices=JUDGES)
    focus: str = setting("all", "the answer tokens the loss takes: all, or lookup-misses, those the lookup member "
                                "would not have drafted as its first choice (serve/adapt_focus.py)", choices=FOCUS)
    seed: int = setting(0)

    def __post_init__(self) -> None:
        check_at_least(self)
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.judge not in JUDGES:
            raise ValueError(f"--judge must be one of {', '.join(JUDGES)}, got {self.judge!r}")
        if self.focus not in FOCUS:
            raise ValueError(f"--focus must be one of {', '.join(FOCUS)}, got {self.focus!r}")


def _latest(root: Path, name: str, base: str | None) -> tuple[str, str]:
    """(label, directory) of the version to fine-tune: the newest not rolled back, else --base."""
    good = [(n, p) for n, p in head_versions(root, name) if not (p / ROLLED_BACK).exists()]
    if good:
        return f"v{good[-1][0]}", str(good[-1][1])
    if base is None:
        raise AdaptError(f"--base: {root / HEADS_DIR / name} holds no version yet; give the head served as {name} "
                         "(its --drafter directory) with --base DIR")
    return "v0", base


def _plan(root: Path, name: str, base: str | None, settings: AdaptSettings) -> tuple[Path, dict]:
    """The run to do or resume: its directory and plan (module docstring, step 1)."""
    versions = head_versions(root, name)
    work = root / ADAPT_DIR / name / f"v{(versions[-1][0] if versions else 0) + 1}"
    if (work / "plan.json").is_file():
        return work, read_json(work / "plan.json", "an adapt plan", AdaptError)
    records = [r for r in read_log(root) if r.get("conversations") and (r.get("served") or {}).get("answer_tokens")]
    if len(records) <= settings.holdout:
        raise AdaptError(f"{root}: the log holds {len(records)} answer(s); adapting needs more than --holdout "
                         f"{settings.holdout} (serve with --learn {root} longer, or lower --holdout)")
    label, start = _latest(root, name, base)
    work.mkdir(parents=True, exist_ok=True)
    write_jsonl(records[:-settings.holdout], work / "train.jsonl")
    write_jsonl(records[-settings.holdout:], work / "heldout.jsonl")
    plan = {"head": name, "version": work.name, "from": label, "from_dir": str(Path(start).resolve()),
            "train_records": len(records) - settings.holdout, "heldout_records": settings.holdout}
    write_json_atomic(work / "plan.json", plan)  # last: the split above is complete
    return work, plan


def acceptance(target, head, records: list[dict], max_new_tokens: int, tree: TreeConfig = TreeConfig(),
               proposer=None) -> float:
    """Generated tokens / verifier calls of greedy decoding with `head` over the records' prompts
    (each decodes as many tokens as its logged answer had, at most max_new_tokens). `proposer`: a
    factory of a fresh proposer per prompt, instead of `head` alone."""
    tokens = calls = 0
    for record in records:
        prompt = chat_ids(target.tokenizer, record["conversations"][:-1])
        n = max(1, min(max_new_tokens, len(record["served"]["answer_tokens"])))
        cfg = DecodeConfig(max_new_tokens=n, stop_token_ids=target.stop_token_ids())
        result = generate(target, proposer() if proposer else SingleProposer(head, tree), prompt, cfg)
        tokens, calls = tokens + len(result.tokens), calls + result.verifier_calls
    return tokens / calls if calls else 0.0


def judge_store(target, work: Path) -> Path:
    """work/judge-store/: a datastore of the training answers, as the online store holds them
    (serve/online_store.answer_segment), written once (a rename makes it whole)."""
    store = work / "judge-store"
    if not is_datastore(store):
        special = special_ids(target.tokenizer)
        segments = [answer_segment(chat_ids(target.tokenizer, r["conversations"][:-1]), r["served"]["answer_tokens"],
                                   special) for _, r in read_json_lines(work / "train.jsonl", AdaptError)]
        tmp = work / f".judge-store.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_datastore(tmp, segments, {"target": target.name,
                                        "tokenizer_fingerprint": target.fingerprint()})
        os.replace(tmp, store)
    return store


def merged_acceptance(target, head_dir: str | Path, store: Path, records: list[dict], max_new_tokens: int) -> float:
    """acceptance() of `merge-budget:HEAD,lookup+STORE` under the fixed tree: the head as a --learn
    server's `lookup` member drafts beside it."""
    spec = variant_from_config("judge", f"merge-budget:{head_dir},lookup+{store}", "taps adapt --judge merge")
    pool = HeadPool(target)
    return acceptance(target, None, records, max_new_tokens, proposer=lambda: pool.proposer(spec, TreeConfig()))


def _publish(trained: Path, final: Path) -> None:
    """The head's two files into `final` by one rename: a server never sees half a version."""
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in (CONFIG_NAME, WEIGHTS_NAME):
        shutil.copy2(trained / file, tmp / file)
    os.replace(tmp, final)


def adapt(root: str | Path, name: str, target: TargetRef, base: str | None = None,
          settings: AdaptSettings = AdaptSettings(), mix=(), say=print) -> str:
    """One adaptation (module docstring) of the head served as `name` with `target` (loaded in
    float32, whatever its dtype: the head trains in float32); returns the summary line."""
    root = Path(root)
    if not (root / "log").is_dir():
        raise AdaptError(f"DIR {root}: no log/ there; expected the directory of `taps serve --learn DIR`")
    if base is not None and not Path(base).is_dir():
        raise AdaptError(f"--base {base}: no such directory; expected the head served as {name}")
    work, plan = _plan(root, name, base, settings)
    final = root / HEADS_DIR / name / plan["version"]
    say(f"taps adapt: {name} {plan['from']} -> {plan['version']} on {plan['train_records']} answers, "
        f"{plan['heldout_records']} held out ({work})")
    loaded = replace(target, dtype="float32").load()
    old = load_head(plan["from_dir"], loaded)
    if not isinstance(old, EagleHead):
        raise AdaptError(f"{plan['from_dir']}: an EAGLE-3 head; taps adapt fine-tunes EAGLE-2 / HASS heads")
    extract_features(loaded, work / "train.jsonl", work / "features", FeatureSettings(max_len=settings.max_len))
    features = work / "features"
    if settings.focus == "lookup-misses":
        focus = focus_features(features, work / "features-lookup-misses", special_ids(loaded.tokenizer))
        say(f"taps adapt: the loss takes the {focus['answer_tokens'] - focus['covered']} of {focus['answer_tokens']} "
            "answer tokens the lookup member misses")
        features = work / "features-lookup-misses"
    cfg = TrainConfig(epochs=settings.epochs, lr=settings.lr, batch_size=settings.batch_size, warmup_steps=0,
                      max_len=settings.max_len, seed=settings.seed,
                      training_data=f"taps serve log {root}" + ("" if settings.focus == "all" else f" ({settings.focus})"))
    trainer = Trainer(loaded, [str(features), *mix], work / "train", cfg, start_from=old)
    if trainer.resume():
        say(f"taps adapt: resumed training at step {trainer.step}/{trainer.total_steps}")
    trained = trainer.fit(progress=False)
    heldout = [row for _, row in read_json_lines(work / "heldout.jsonl", AdaptError)]
    scores = read_json(work / "eval.json", "an adapt evaluation", AdaptError) if (work / "eval.json").is_file() else {}
    # eval.json keys: before / after (the head alone), before_merge / after_merge (--judge merge)
    suffix = "" if settings.judge == "head" else "_merge"
    store = judge_store(loaded, work) if settings.judge == "merge" else None

    def score(head_dir) -> float:
        if store is not None:
            return merged_acceptance(loaded, head_dir, store, heldout, settings.max_new_tokens)
        return acceptance(loaded, old if head_dir == plan["from_dir"] else load_head(head_dir, loaded), heldout,
                          settings.max_new_tokens)

    for key, head_dir in ((f"before{suffix}", plan["from_dir"]), (f"after{suffix}", trained)):
        if key not in scores:
            scores[key] = score(head_dir)
            write_json_atomic(work / "eval.json", scores)
    before, after = scores[f"before{suffix}"], scores[f"after{suffix}"]
    better = after > before
    if better and not final.exists():
        _publish(trained, final)
    verdict = f"wrote {final}" if better else f"kept {plan['from']}: no version written"
    judged = "" if store is None else " merged with lookup + the training answers' datastore"
    return (f"taps adapt: held-out acceptance length{judged} {before:.3f} ({plan['from']}) -> "
            f"{after:.3f} (fine-tuned); {verdict}")
