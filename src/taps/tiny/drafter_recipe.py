"""Recipe for the embedded default's specialist drafters, with the project's own pipeline:
`taps data mix` -> `taps features` -> `taps train`, for both backbones and four training sets,
in the paper's proportions at a CPU scale (N records per domain):

    chat         N English ShareGPT conversations
    math         N GSM8K-train problems (our offline stand-in for MathInstruct)
    mixed-small  N/2 chat + N/2 math   (the paper's 35k + 35k)
    mixed-large  N chat + N math       (the paper's 70k + 70k)

Features are computed once per domain; the mixtures reuse prefixes of them (a smaller draw is a
prefix of a larger one). Every stage is resumable: rerunning the command skips finished data,
features and drafters and resumes an interrupted training from its last checkpoint.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

DOMAINS = ("chat", "math", "mixed-small", "mixed-large")
BACKBONES = ("eagle2", "hass")


@dataclass
class DrafterRecipe:
    data_dir: str | None = None
    chat_source: str = "sharegpt"
    math_source: str = "gsm8k:train"
    n_per_domain: int = 2000
    max_len: int = 512  # tokens per training conversation (features are cut there)
    epochs: int = 6
    lr: float = 1e-3  # a small head trained for few epochs: higher than the paper's 3e-5 for an 8B head
    batch_size: int = 8
    warmup_steps: int = 100
    seed: int = 0
    backbones: tuple[str, ...] = BACKBONES
    domains: tuple[str, ...] = DOMAINS
    threads: int | None = None
    device: str = "cpu"  # the target's device for features and training ("auto" takes a GPU)
    dtype: str = "float32"  # the target's weights
    feature_dtype: str = "fp32"  # stored features: fp32 for exact CPU runs, bf16 at 8B scale
    checkpoint_steps: int | None = 100  # besides every epoch end, so a killed run loses little


def log(msg: str) -> None:
    print(f"[tiny-drafters {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _domain_data(recipe: DrafterRecipe, work: Path) -> dict[str, Path]:
    from taps.data.mix import mix_sources, write_jsonl

    files = {}
    for domain, source, english in (("chat", recipe.chat_source, True), ("math", recipe.math_source, False)):
        path = work / f"{domain}.jsonl"
        if not path.is_file():
            records = mix_sources([f"{source}:{recipe.n_per_domain}"], recipe.seed, recipe.data_dir, english=english,
                                  on_report=lambda r: log(str(r)))
            write_jsonl(records, path)
            log(f"{domain}: {len(records)} records -> {path}")
        files[domain] = path
    return files


def feature_specs(domain: str, features: dict[str, Path], n: int) -> list[str]:
    """The features each training set uses: whole domains, or the first N/2 of each."""
    return {"chat": [str(features["chat"])], "math": [str(features["math"])],
            "mixed-small": [f"{features['chat']}:{n // 2}", f"{features['math']}:{n // 2}"],
            "mixed-large": [str(features["chat"]), str(features["math"])]}[domain]


def build_drafters(recipe: DrafterRecipe, target_dir: str | Path, out: str | Path, work: str | Path) -> dict:
    import torch

    from taps.data.features import FeatureSettings, extract_features
    from taps.target import Target
    from taps.train.trainer import TrainConfig, Trainer

    out, work = Path(out), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    unknown = set(recipe.domains) - set(DOMAINS) | set(recipe.backbones) - set(BACKBONES)
    if unknown:
        raise ValueError(f"unknown domain or backbone {sorted(unknown)}; domains: {DOMAINS}, backbones: {BACKBONES}")
    target = Target.load(target_dir, device=recipe.device, dtype=recipe.dtype)
    data = _domain_data(recipe, work)
    features = {}
    for domain, path in data.items():
        features[domain] = work / f"features-{domain}"
        manifest = extract_features(target, path, features[domain], FeatureSettings(max_len=recipe.max_len, dtype=recipe.feature_dtype))
        log(f"features {domain}: {manifest['records_done']} records, {manifest['tokens']:,} tokens, "
            f"{manifest['assistant_tokens']:,} assistant tokens")
    summary_path = out / "drafters.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary["recipe"] = asdict(recipe)
    for backbone in recipe.backbones:
        for domain in recipe.domains:
            name = f"{backbone}-{domain}"
            head_dir = out / name
            if (head_dir / "model.safetensors").is_file() and name in summary.get("drafters", {}):
                log(f"{name}: done, skipped")
                continue
            cfg = TrainConfig(backbone=backbone, epochs=recipe.epochs, lr=recipe.lr, batch_size=recipe.batch_size,
                              warmup_steps=recipe.warmup_steps, seed=recipe.seed, training_data=domain,
                              checkpoint_steps=recipe.checkpoint_steps)
            run_dir = work / f"train-{name}"  # checkpoints stay in the work directory
            trainer = Trainer(target, feature_specs(domain, features, recipe.n_per_domain), run_dir, cfg)
            if trainer.resume():
                log(f"{name}: resumed at step {trainer.step}/{trainer.total_steps}")
            t0 = time.time()
            trainer.fit()
            head_dir.mkdir(parents=True, exist_ok=True)
            for file in ("config.json", "model.safetensors", "metrics.jsonl"):  # the shipped drafter: no optimizer
                shutil.copyfile(run_dir / file, head_dir / file)
            epochs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if "heldout_loss" in x]
            summary.setdefault("drafters", {})[name] = {
                "records": len(trainer.shards), "features": trainer.shards.description, "steps": trainer.step,
                "wall_time_s_last_run": round(time.time() - t0, 1), "train_seconds": round(trainer.train_seconds, 1),
                "timed_from_step": trainer.timed_from_step, "final": epochs[-1] if epochs else {}}
            out.mkdir(parents=True, exist_ok=True)
            summary_path.write_text(json.dumps(summary, indent=2) + "\n")
            log(f"{name}: {summary['drafters'][name]['final']}")
    return summary
