"""Drafter training (EAGLE-2, HASS or EAGLE-3) on target features, from one CPU to many GPUs.

The same code runs alone or under `accelerate launch --num_processes N`: every process takes a
fixed slice of each global batch and the head's gradients are summed across processes before
the optimizer step (data parallelism, as DDP does). Losses are averaged over all counted
positions of the global batch (train/losses.py `pooled_loss`), and each sample's feature noise
is drawn from a generator seeded by (seed, epoch, sample), so N processes with per-process batch
B/N reproduce one process with batch B up to float summation order.

Determinism and resume: the epoch order, the batches and the noise are pure functions of the
seed and the global step, so a run resumed from any checkpoint ends at the same weights as an
uninterrupted one. A checkpoint holds the head in the EAGLE layout (docs/spec.md §7), the optimizer and the
RNG (train/state.py); one is written at the end of every epoch (and every --checkpoint-steps).

Micro-batches: each global batch is sorted by record length before it is split into micro-batches
and processes (`_by_length`), so a micro-batch pads to a similar length instead of a random one;
the step's loss and gradient are those of the whole global batch either way.

Draft vocabulary (--draft-vocab N): the head drafts over the N most frequent loss tokens of the
training records (train/draft_vocab.py; the target's stop tokens always included), chosen once
before the first step, deterministically, so a resumed run chooses the same; its loss terms run
over those N tokens (train/losses.py). The mapping is saved with the head (d2t / t2d), and a
resume under another draft vocabulary is refused.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from taps.core.config import check_at_least, setting
from taps.data.features import FeatureSet
from taps.drafter.checkpoint import DrafterInfo, init_head, save_head
from taps.core.identity import MismatchError, check_same
from taps.core.jsonl import append_jsonl, read_json, read_jsonl, write_jsonl
from taps.core.outlock import output_lock
from taps.core.outputs import check_output_dir
from taps.core.target import Target
from taps.train.draft_vocab import DraftVocab, choose_draft_vocab
from taps.train.losses import (Eagle2Config, Eagle3Config, HassConfig, counted_positions, eagle2_loss, eagle3_loss,
                               hass_loss, pad_batch, pooled_loss)
from taps.train.state import latest_checkpoint, load_checkpoint, save_checkpoint

BACKBONES = ("eagle2", "hass", "eagle3")
# TrainConfig fields that change the trained weights or the saved head: a resume under another value
# is refused. The rest (checkpoint_steps, log_every, compile_loss: the same loss up to float summation
# order, keep_epoch_heads) may change between runs.
CONTENT_FIELDS = ("backbone", "epochs", "lr", "batch_size", "grad_accum", "warmup_steps", "max_grad_norm", "max_len",
                  "heldout_frac", "hass_topk", "hass_steps", "noise_width", "seed", "mixed_precision",
                  "training_data", "draft_vocab", "ttt_steps", "ttt_decay", "init_from_target", "freeze_lm_head",
                  "ttt_feature_weight")


class TrainingError(RuntimeError):
    pass


@dataclass
class TrainConfig:
    # the fields declared with setting() are `taps train`'s options (cli/args.add_settings)
    backbone: str = setting("eagle2", choices=BACKBONES)
    epochs: int = setting(20, at_least=1)
    lr: float = setting(3e-5)
    batch_size: int = setting(8, "per process", at_least=1)  # global batch = batch_size * processes * grad_accum
    grad_accum: int = setting(1, at_least=1)
    warmup_steps: int = setting(2000, at_least=0)  # linear warm-up, then linear decay to 0 (the EAGLE schedule)
    max_grad_norm: float = 0.5
    max_len: int | None = setting(None, "cut samples to this many tokens", at_least=1)  # EAGLE 2048, HASS 1024
    heldout_frac: float = 0.05
    hass_topk: int = setting(10, at_least=1)
    hass_steps: int = setting(3, at_least=1)
    noise_width: float = setting(0.2, "EAGLE-2 / HASS input noise (EAGLE-3 adds none)")
    ttt_steps: int = setting(7, "EAGLE-3: training-time test steps unrolled (the reference's 7)", at_least=1)
    ttt_decay: float = setting(0.8, "EAGLE-3: step j's loss weight is DECAY ** (j - 1) (the reference's 0.8)")
    ttt_feature_weight: float = setting(
        0.0, "EAGLE-3: add W x SmoothL1(normed step-1 output, the target's next feature) to the first step's loss "
             "(EAGLE-2's dense feature regression at depth 1, an experiment; the reference has none; on SmolLM2 it "
             "changed nothing: docs/eagle3.md)", metavar="W")
    init_from_target: bool = setting(
        True, "EAGLE-3: start the head's norm and LM head from the target's final norm and LM-head rows "
              "(--no-init-from-target: random, as the reference)")
    freeze_lm_head: bool = setting(
        False, "EAGLE-3: keep the head's own norm and LM head at the target's (needs the init from the target) and "
               "train the rest (an experiment for little data; on SmolLM2 it did worse: docs/eagle3.md)")
    seed: int = setting(0)
    checkpoint_steps: int | None = setting(None, "also checkpoint every N steps (always every epoch)", at_least=1)
    log_every: int = 10
    mixed_precision: str = setting("no", choices=("no", "bf16", "fp16"))  # accelerate's
    compile_loss: bool = setting(  # losses.Eagle2Config.compile
        False, "torch.compile the vocabulary-sized loss terms into fused kernels (same loss; faster steps after a "
               "one-off compile; needs a C++ compiler on the CPU)", flag="--compile")
    training_data: str = setting("", "a label recorded in the drafter's config")
    draft_vocab: int | None = setting(
        None, "draft over the N most frequent target tokens of the training data (EAGLE-3's reduced vocabulary; the "
              "target's stop tokens always included): [.., N] instead of [.., V] LM-head terms; default: the full "
              "vocabulary", at_least=1, metavar="N")
    keep_epoch_heads: bool = setting(  # learning curves; a run cut short still leaves its last finished epoch's head
        False, "also write each epoch's head to OUT/epochs/epoch-NN")

    def __post_init__(self) -> None:
        if self.backbone not in BACKBONES:
            raise ValueError(f"unknown backbone {self.backbone!r}; expected one of {', '.join(BACKBONES)}")
        check_at_least(self)  # epochs, batch_size, grad_accum, warmup_steps, max_len, hass_*, draft_vocab, ...
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.noise_width < 0:
            raise ValueError(f"noise_width must be >= 0, got {self.noise_width}")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"ttt_decay must lie in (0, 1], got {self.ttt_decay}")
        if self.ttt_feature_weight < 0 or (self.ttt_feature_weight and self.backbone != "eagle3"):
            raise ValueError("ttt_feature_weight (option --ttt-feature-weight) must be >= 0 and is EAGLE-3's "
                             f"(--backbone eagle3), got {self.ttt_feature_weight} with --backbone {self.backbone}")
        if self.freeze_lm_head and (self.backbone != "eagle3" or not self.init_from_target):
            raise ValueError("freeze_lm_head (option --freeze-lm-head) keeps an EAGLE-3 head's own LM head at the "
                             "target's rows: it needs --backbone eagle3 and the init from the target")

    def loss_config(self, noise: bool = True, depths: int | None = None):
        """The backbone's objective; with `depths`, its terms over that many aligned steps (for
        top-1 agreement at depths 1..depths, whatever the backbone). Training (noise on) skips the
        top-1 metric, evaluation (noise off) computes it."""
        common = dict(noise_width=self.noise_width, top1=False) if noise else dict(noise_width=0.0, top1=True)
        common["compile"] = self.compile_loss
        if self.backbone == "eagle3":
            return Eagle3Config(steps=depths or self.ttt_steps, step_decay=self.ttt_decay, top1=common["top1"],
                                compile=self.compile_loss, feature_weight=self.ttt_feature_weight)
        if self.backbone == "hass":
            return HassConfig(topk=self.hass_topk, steps=depths or self.hass_steps, **common)
        if depths:
            return HassConfig(topk=self.hass_topk, steps=depths, topk_weight=0.0, **common)
        return Eagle2Config(**common)

    @property
    def loss_steps(self) -> int:
        return {"hass": self.hass_steps, "eagle3": self.ttt_steps}.get(self.backbone, 1)


def has_compiler() -> bool:
    """A C++ compiler torch.compile's CPU backend can use: $CXX, g++, clang++ or c++ on PATH."""
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "clang++", "c++") if c)


def require_compiler(device: torch.device) -> None:
    """torch.compile on the CPU builds C++ kernels; without a compiler it fails at the first step
    with a long traceback, so the missing piece is named up front instead."""
    if device.type == "cpu" and not has_compiler():
        raise TrainingError("--compile on the CPU needs a C++ compiler for torch.compile (g++ or clang++ on "
                            "PATH, or $CXX); install one or train without --compile")


def split_indices(n: int, frac: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_hold = max(1, round(frac * n)) if n > 1 else 0
    return sorted(order[n_hold:]), sorted(order[:n_hold])


def sample_noise(seed: int, epoch: int, index: int, length: int, hidden: int) -> torch.Tensor:
    """U[-1/2, 1/2) draws [length - 1, H] for one sample's input features, layout-independent."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_003 + index)
    return torch.rand(max(length - 1, 0), hidden, generator=gen) - 0.5


def lr_factor(step: int, warmup: int, total: int) -> float:
    if warmup and step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


class Trainer:
    def __init__(self, target, features: str | Path | list[str], out: str | Path, cfg: TrainConfig, accelerator=None,
                 start_from=None):
        """`start_from`: a trained EAGLE-2 / HASS head whose weights (and draft vocabulary, if it has
        one) the run starts from instead of a fresh head (`taps adapt` fine-tunes the served head);
        a resume restores the checkpoint over it."""
        from accelerate import Accelerator

        self.cfg, self.out = cfg, Path(out)
        self.acc = accelerator or Accelerator(mixed_precision=cfg.mixed_precision)
        if cfg.compile_loss:
            require_compiler(self.acc.device)
        self.out.mkdir(parents=True, exist_ok=True)
        self.target = target
        target.model.requires_grad_(False)
        self.shards = FeatureSet.from_specs(features, fingerprint=target.fingerprint(),
                                            target_weights=target.identity()["target_weights"])
        if self.shards.hidden_size != target.hidden_size:
            raise TrainingError(f"{self.shards.description}: features of hidden size {self.shards.hidden_size}, "
                                f"the target's is {target.hidden_size}")
        self.train_idx, self.heldout_idx = split_indices(len(self.shards), cfg.heldout_frac, cfg.seed)
        self.global_batch = cfg.batch_size * self.acc.num_processes * cfg.grad_accum
        self.steps_per_epoch = len(self.train_idx) // self.global_batch
        if self.steps_per_epoch == 0:
            raise TrainingError(f"{len(self.train_idx)} training records are fewer than one global batch of "
                                f"{self.global_batch} ({cfg.batch_size} x {self.acc.num_processes} processes x "
                                f"{cfg.grad_accum} accumulation)")
        self.total_steps = self.steps_per_epoch * cfg.epochs
        if cfg.backbone == "eagle3" and not self.shards.aux_layers:
            raise TrainingError(f"{self.shards.description}: no aux layers; an EAGLE-3 head reads the target's low / "
                                "middle / high layers: extract the features with `taps features --aux-layers auto`")
        self.draft_vocab: DraftVocab | None = None
        if cfg.draft_vocab is not None:
            self.draft_vocab = choose_draft_vocab(self.shards, target.vocab_size, cfg.draft_vocab, self.train_idx,
                                                  cfg.max_len, always=target.stop_token_ids())
        # an EAGLE-3 head's own LM head is sized by its draft vocabulary, so that comes first
        if start_from is not None and (cfg.backbone == "eagle3" or cfg.draft_vocab is not None
                                       or not hasattr(start_from, "bias")):
            raise TrainingError("fine-tuning starts from an EAGLE-2 / HASS head, with the draft vocabulary it has; "
                                "this head is an EAGLE-3 head, or a new draft vocabulary was asked for")
        if start_from is not None and start_from.draft_ids is not None:  # kept as it was chosen for the head
            self.draft_vocab = DraftVocab(start_from.draft_ids.cpu(), coverage=float("nan"), counted=0)
        self.head = init_head(target.model.config, seed=cfg.seed, backbone=cfg.backbone,
                              bias=bool(getattr(start_from, "bias", False)),
                              draft_vocab_size=self.draft_vocab.ids.numel() if self.draft_vocab else None,
                              aux_layers=self.shards.aux_layers or None).to(self.acc.device)
        if start_from is not None:
            self.head.load_state_dict(start_from.state_dict())
        self.head.bind(target.embed_tokens, target.lm_head)
        if self.draft_vocab is not None:
            self.head.set_draft_vocab(self.draft_vocab.ids)
        if cfg.backbone == "eagle3" and cfg.init_from_target:
            self.head.init_from_target(target)
        if cfg.freeze_lm_head:  # the target's final norm and LM-head rows stay as they are
            for module in (self.head.norm, self.head.lm_head):
                module.requires_grad_(False)
        trained = [p for p in self.head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=cfg.lr, betas=(0.9, 0.95))
        self.step = 0
        # wall time of fit() summed over resumed runs, and the step it was first counted from
        # (a checkpoint written before this clock existed starts it at its own step)
        self.train_seconds, self.timed_from_step = 0.0, 0

    # ---- data -----------------------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> list[int]:
        perm = torch.randperm(len(self.train_idx), generator=torch.Generator().manual_seed(self.cfg.seed * 7919 + epoch))
        return [self.train_idx[i] for i in perm.tolist()]

    def _micro_batches(self, step: int):
        """This process's micro-batches of global step `step`, and the counted positions of the
        whole global batch (summed over processes) for pooling the loss."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        order = self._by_length(self._epoch_order(epoch)[offset * self.global_batch:(offset + 1) * self.global_batch])
        per_micro = self.cfg.batch_size * self.acc.num_processes
        micro = []
        for m in range(self.cfg.grad_accum):
            chunk = order[m * per_micro:(m + 1) * per_micro]
            mine = chunk[self.acc.process_index * self.cfg.batch_size:(self.acc.process_index + 1) * self.cfg.batch_size]
            micro.append(self._batch(mine, epoch))
        totals = sum(counted_positions(b, self.cfg.loss_steps) for b, _ in micro)
        return micro, self.acc.reduce(totals.to(self.acc.device), reduction="sum")

    def _by_length(self, indices: list[int]) -> list[int]:
        """`indices` longest first (ties in index order): consecutive micro-batches then hold records
        of similar length, so a batch padded to its longest record pads little. The global batch is
        the same set, and its loss is pooled over all of it (pooled_loss), so only the float summation
        order changes; random micro-batches of 4 from the xl set padded to 1.43x their real tokens."""
        cut = self.cfg.max_len or float("inf")
        return sorted(indices, key=lambda i: (-min(self.shards.record_length(i), cut), i))

    def _batch(self, indices: list[int], epoch: int):
        samples, noises = [], []
        for i in indices:
            rec = self.shards[i]
            n = rec["input_ids"].shape[0] if self.cfg.max_len is None else min(self.cfg.max_len, rec["input_ids"].shape[0])
            sample = (rec["input_ids"][:n].long(), rec["hidden"][:n].float(), rec["loss_mask"][:n])
            if self.cfg.backbone == "eagle3":
                samples.append((*sample, rec["aux"][:n].float()))  # [n, k * H] the head's input layers
            else:
                samples.append(sample)
                noises.append(sample_noise(self.cfg.seed, epoch, i, n, self.target.hidden_size))
        batch = pad_batch(samples)
        dev = self.acc.device
        batch = type(batch)(input_ids=batch.input_ids.to(dev), hidden=batch.hidden.to(dev),
                            loss_mask=batch.loss_mask.to(dev), lengths=batch.lengths.to(dev),
                            aux=None if batch.aux is None else batch.aux.to(dev))
        if not noises:  # EAGLE-3: no input noise
            return batch, None
        width = batch.input_ids.shape[1] - 1
        noise = torch.zeros(len(indices), width, self.target.hidden_size)  # [B, T-1, H]
        for row, nz in enumerate(noises):
            noise[row, : nz.shape[0]] = nz
        return batch, noise.to(dev)

    def _loss(self, batch, noise, cfg):
        fn = {HassConfig: hass_loss, Eagle3Config: eagle3_loss}.get(type(cfg), eagle2_loss)
        with self.acc.autocast():
            return fn(self.head, batch, cfg, noise=noise)

    # ---- checkpoints ----------------------------------------------------------------------------
    def info(self) -> DrafterInfo:
        extra = {"train_config": asdict(self.cfg), "steps": self.step, "features": self.shards.description,
                 "train_seconds": round(self.train_seconds, 1), "timed_from_step": self.timed_from_step}
        if self.draft_vocab is not None and self.draft_vocab.counted:  # not measured for a kept vocabulary
            extra["draft_vocab_coverage"] = round(self.draft_vocab.coverage, 6)
        return DrafterInfo(backbone=self.cfg.backbone, training_data=self.cfg.training_data,
                           target_name=self.target.name,
                           tokenizer_fingerprint=self.target.fingerprint(),
                           extra=extra)

    def _draft_vocab_state(self) -> dict:
        """What a resume must find unchanged: the draft vocabulary's size and a digest of its ids."""
        ids = self.draft_vocab.ids if self.draft_vocab is not None else None
        digest = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16] if ids is not None else None
        return {"draft_vocab": self.cfg.draft_vocab, "draft_vocab_digest": digest}

    def run_settings(self) -> dict:
        """Everything the weights depend on: the content fields of the config, the features (by
        content) and the target's weights. A resume with any difference is refused."""
        return {**{k: getattr(self.cfg, k) for k in CONTENT_FIELDS}, "features": self.shards.identity(),
                "target_weights": self.target.identity()["target_weights"]}

    def resume(self) -> bool:
        ckpt = latest_checkpoint(self.out / "ckpt")
        if ckpt is None:
            return False
        # checked before any state is restored
        extra = read_json(ckpt / "state.json", "a training checkpoint's state", TrainingError).get("extra", {})
        if extra.get("global_batch") != self.global_batch:
            raise TrainingError(f"{ckpt}: saved with global batch {extra.get('global_batch')}, this run "
                                f"has {self.global_batch}; resume with the same batch layout")
        for key, ours in self._draft_vocab_state().items():  # a checkpoint without them: full vocabulary
            if extra.get(key) != ours:
                raise TrainingError(f"{ckpt}: saved with {key} {extra.get(key)}, this run has {ours}; resume with "
                                    "the same --draft-vocab (and the same training features)")
        saved, ours = extra.get("run_settings", {}), self.run_settings()
        try:  # a checkpoint written before run settings were recorded: accepted once, recorded from now on
            check_same(ckpt, saved, ours, tuple(ours), "resume with the same settings, or train into another --out")
        except MismatchError as err:
            raise TrainingError(str(err)) from None
        state = load_checkpoint(ckpt, self.head, self.optimizer)
        self.step = int(state["step"])
        self.train_seconds = float(extra.get("train_seconds", 0.0))
        self.timed_from_step = int(extra["timed_from_step"]) if "timed_from_step" in extra else self.step
        return True

    def _save(self, metrics: dict) -> None:
        if self.acc.is_main_process:
            save_checkpoint(self.out / "ckpt", self.step, self.head, self.optimizer,
                            extra={"global_batch": self.global_batch, "metrics": metrics,
                                   "run_settings": self.run_settings(),
                                   "train_seconds": self.train_seconds, "timed_from_step": self.timed_from_step,
                                   **self._draft_vocab_state()})
            save_head(self.head, self.out / "ckpt" / f"step-{self.step:06d}" / "head", self.info())
        self.acc.wait_for_everyone()

    # ---- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss (the backbone's own) and top-1 agreement with the target at depths 1..3."""
        self.head.eval()
        mine = self._by_length(self.heldout_idx[self.acc.process_index::self.acc.num_processes])  # sums: any order
        sums = torch.zeros(8, device=self.acc.device)  # loss*n, n, top1@1..3 * n_j, n_1..n_3
        own_cfg, deep_cfg = self.cfg.loss_config(noise=False), self.cfg.loss_config(noise=False, depths=3)
        for start in range(0, len(mine), self.cfg.batch_size):
            batch, _ = self._batch(mine[start:start + self.cfg.batch_size], epoch=0)
            own = self._loss(batch, None, own_cfg)
            sums[0] += own.loss.float() * own.steps[0].count
            sums[1] += own.steps[0].count
            for j, s in enumerate(self._loss(batch, None, deep_cfg).steps):
                sums[2 + j] += s.top1.float() * s.count
                sums[5 + j] += s.count
        sums = self.acc.reduce(sums, reduction="sum")
        self.head.train()
        out = {"heldout_loss": float(sums[0] / sums[1].clamp(min=1))}
        out.update({f"heldout_top1_depth{j + 1}": float(sums[2 + j] / sums[5 + j].clamp(min=1)) for j in range(3)})
        return out

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self, progress: bool = True) -> Path:
        log = self.out / "metrics.jsonl" if self.acc.is_main_process else None
        if log:
            log.touch()
            rows, _ = read_jsonl(log, repair_torn=True)  # a line torn by a crash is cut before appending
            if any(row.get("step", 0) > self.step for _, row in rows):  # logged after the checkpoint resumed
                write_jsonl([row for _, row in rows if row.get("step", 0) <= self.step], log)
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not (progress and self.acc.is_main_process),
                   desc=f"train {self.cfg.backbone}", unit="step", dynamic_ncols=True)
        window_t, window_tokens, last = time.time(), 0, {}
        clock = time.time()
        self.head.train()
        while self.step < self.total_steps:
            micro, totals = self._micro_batches(self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = self.cfg.lr * lr_factor(self.step, self.cfg.warmup_steps, self.total_steps)
            step_loss = torch.zeros((), device=self.acc.device)
            cfg = self.cfg.loss_config()
            for batch, noise in micro:
                out = self._loss(batch, noise, cfg)
                if not torch.isfinite(out.loss):
                    raise TrainingError(
                        f"non-finite loss ({float(out.loss.detach())}) at step {self.step} (epoch "
                        f"{self.step // self.steps_per_epoch + 1}); stopped without saving; last good checkpoint: "
                        f"{latest_checkpoint(self.out / 'ckpt')}")
                share = pooled_loss(out, cfg, totals)
                share.backward()
                step_loss += share.detach()
                window_tokens += int(batch.lengths.sum())
            for p in self.head.parameters():  # data parallel: sum the gradient shares of all processes
                if p.grad is not None:
                    p.grad = self.acc.reduce(p.grad, reduction="sum")
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            now = time.time()
            self.train_seconds, clock = self.train_seconds + now - clock, now
            loss = float(self.acc.reduce(step_loss, reduction="sum"))
            bar.update(1)
            if self.step % self.cfg.log_every == 0 or self.step == self.total_steps:
                tps = window_tokens * self.acc.num_processes / max(time.time() - window_t, 1e-9)
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:.0f}")
                if log:
                    append_jsonl(log, [{"step": self.step, "epoch": self.step / self.steps_per_epoch, "loss": loss,
                                        "lr": self.optimizer.param_groups[0]["lr"], "tokens_per_s": tps}])
                window_t, window_tokens = time.time(), 0
            end_of_epoch = self.step % self.steps_per_epoch == 0
            if end_of_epoch:
                last = {"epoch": self.step // self.steps_per_epoch, "step": self.step, **self.evaluate()}
                if log:
                    append_jsonl(log, [last])
                bar.write(f"epoch {last['epoch']}: " + ", ".join(f"{k} {v:.4f}" for k, v in last.items()
                                                                    if k not in ("epoch", "step")))
            if end_of_epoch or (self.cfg.checkpoint_steps and self.step % self.cfg.checkpoint_steps == 0):
                self._save(last)
            if end_of_epoch and self.cfg.keep_epoch_heads and self.acc.is_main_process:
                save_head(self.head, self.out / "epochs" / f"epoch-{self.step // self.steps_per_epoch:02d}", self.info())
        bar.close()
        if self.acc.is_main_process:
            save_head(self.head, self.out, self.info())
        self.acc.wait_for_everyone()
        return self.out


def train_drafter(target_dir: str, features: str | list[str], out: str, cfg: TrainConfig, resume: bool = False,
                  device: str | None = None, force: bool = False) -> Path:
    """`taps train`: load the target (for its embedding, LM head and tokenizer) and fit a head; the
    main process prints where it is saved. `out` holds no other kind of result (taps.core.outputs), a
    head already there (without a run to resume) is replaced only with `force`, and a --resume
    that finds no checkpoint says so before it starts from step 0."""
    try:
        from accelerate import Accelerator
    except ImportError:
        raise TrainingError("training needs the `train` extra: pip install 'taps[train]'") from None


    out_path = check_output_dir(out, "drafter", inputs=[("--target", target_dir)])
    acc = Accelerator(mixed_precision=cfg.mixed_precision, cpu=device == "cpu")
    # the frozen embedding / LM head run in the head's precision: fp32 unless mixed precision is on
    target = Target.load(target_dir, device=str(acc.device), dtype="float32" if cfg.mixed_precision == "no" else "auto")
    with writer_lock(out_path, acc.is_main_process):
        if (out_path / "ckpt").exists() and not resume:
            raise TrainingError(f"{out_path / 'ckpt'} exists: pass --resume to continue it, or choose another --out")
        if not (out_path / "ckpt").exists() and not force:  # a head of another command (drafter init, average)
            check_output_dir(out_path, "drafter", force=False)
        trainer = Trainer(target, features, out_path, cfg, accelerator=acc)
        resumed = resume and trainer.resume()
        if acc.is_main_process and resumed:
            print(f"resumed at step {trainer.step}/{trainer.total_steps}")
        elif acc.is_main_process and resume:
            print(f"taps train: --resume: no checkpoint in {out_path / 'ckpt'}; starting from step 0",
                  file=sys.stderr)
        saved = trainer.fit()
    if acc.is_main_process:
        print(f"drafter saved to {saved}")
    return saved


def writer_lock(out: Path, main_process: bool = True):
    """The run directory's one-writer lock (taps.core.outlock), taken by the main process only."""
    return output_lock(out, "training") if main_process else nullcontext()
