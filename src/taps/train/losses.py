"""EAGLE-2 and HASS training objectives for the EAGLE head (docs/spec.md §6), on teacher-forced batches.

Alignment. For one sequence of T tokens (positions 0..T-1, of which the first `length` are real):

    head input pair t  = (input_ids[t+1], hidden[t])       t = 0 .. T-2, rotary position t
    its output         ~ hidden[t+1]                       feature regression (SmoothL1)
    lm_head(output)    ~ softmax(lm_head(hidden[t+1]))     the target's distribution over token t+2
    counted            iff loss_mask[t+1] == 1 and t + 1 < length

This is the inference convention of drafter/context.py: the head consumes (embed(token_{t+1}),
feature_t) at position t and its output at t predicts feature_{t+1}.

Why loss_mask[t+1]: everything pair t is trained on is a property of position t+1 (its feature and
the distribution it induces over token t+2), so the pair counts exactly when position t+1 is an
assistant token. At inference the target itself produces the first assistant token a0 (prefill);
the head's first draft comes from pair a0 - 1 (context consumed up to a0) and proposes a0 + 1 —
that pair is counted (loss_mask[a0] = 1), while no pair whose regression target is a prompt
position is. The EAGLE reference code counts pair t by loss_mask[t] instead: one position later,
which skips the first draft of every response and counts one pair past its end.

Padding: sequences are right-padded. A real query t only sees keys p <= t, and every such p is a
real token, so causality alone keeps padded positions out of every real position's output; the
loss weight excludes them (t + 1 < length) whatever their loss_mask says.

HASS harmonized context alignment (`steps` forward passes). Step j at position t reproduces the
head's depth-j draft of a chain after a committed context of c = t - j + 2 pairs: inference
consumes pairs 0..c-1 with true features, drafts depth 1 from the output at c-1, and at depth
d >= 2 runs the head at position c + d - 2 on (next token, its own output at depth d-1). With
teacher-forced tokens, the query at t in step j therefore sees
    keys p <= t - (j-1)       the rows of step 1 (true features);
    keys p in (t-(j-1), t]    the rows of step j - (t - p), fed the head's own detached outputs.
`alignment_mask` builds exactly this pattern over the key rows of steps 1..j held in one cache
(every row rotated at its true position), so training attention equals inference attention
(tests/test_losses.py checks it against the decoder's own functions). The authors' HASS code
fills masked logits with 0 instead of -inf in these steps, i.e. applies no causal mask there;
this module does not.

Draft vocabulary (a head with `draft_ids`, drafter/head.py; EAGLE-3's reduced vocabulary). Every
vocabulary-sized term runs over the N draft tokens: q is the target's distribution restricted to
them and renormalised (softmax of the target's logits over those N rows), the head's log-softmax
is over N, and HASS's top-K is taken in draft index space. So the [.., V] matmuls and passes
become [.., N]. The top-1 metric stays honest: the head's argmax, mapped to a target id, against
the target's argmax over its FULL vocabulary (one [P, V] matmul, only when top1 is computed, i.e.
in evaluation); a target argmax outside the draft vocabulary is a miss.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from taps.core import kv
from taps.drafter.context import causal_block_mask
from taps.drafter.head import DraftHead
from taps.train.band_attention import BAND_KWARG, AlignedRows, band_attention_in


# ---- the batch -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainBatch:
    """Teacher-forced sequences, right-padded to a common length T."""

    input_ids: Tensor  # [B, T] long, padded with any valid id
    hidden: Tensor  # [B, T, H] target features (HF hidden_states[-1], after the final norm)
    loss_mask: Tensor  # [B, T] 1 on assistant tokens (any value on padding)
    lengths: Tensor  # [B] long, real tokens per row (positions >= length are padding)
    aux: Tensor | None = None  # [B, T, k * H] the target's low / middle / high layers (EAGLE-3's input), or None

    def __post_init__(self) -> None:
        b, t = self.input_ids.shape
        if self.aux is not None and self.aux.shape[:2] != (b, t):
            raise ValueError(f"TrainBatch shapes disagree: input_ids {tuple(self.input_ids.shape)}, aux "
                             f"{tuple(self.aux.shape)}")
        if self.hidden.shape[:2] != (b, t) or self.loss_mask.shape != (b, t) or self.lengths.shape != (b,):
            raise ValueError(
                f"TrainBatch shapes disagree: input_ids {tuple(self.input_ids.shape)}, hidden "
                f"{tuple(self.hidden.shape)}, loss_mask {tuple(self.loss_mask.shape)}, "
                f"lengths {tuple(self.lengths.shape)}"
            )
        if t < 2:
            raise ValueError(f"TrainBatch needs T >= 2 (one head pair uses two positions), got T = {t}")
        if bool(((self.lengths < 0) | (self.lengths > t)).any()):
            raise ValueError(f"TrainBatch.lengths must lie in [0, {t}], got {self.lengths.tolist()}")


def pad_batch(samples: Sequence[tuple[Tensor, ...]]) -> TrainBatch:
    """Right-pad (input_ids [T_i], hidden [T_i, H], loss_mask [T_i][, aux [T_i, k * H]]) samples into
    one TrainBatch (aux: every sample has it, or none)."""
    lengths = torch.tensor([int(sample[0].shape[0]) for sample in samples], dtype=torch.long)  # [B]
    t = int(lengths.max())
    ids0, hidden0, mask0 = samples[0][:3]
    b = len(samples)

    def padded(column: int, like: Tensor) -> Tensor:  # [B, T, ...] zeros, then each sample's rows
        out = torch.zeros(b, t, *like.shape[1:], dtype=like.dtype, device=like.device)
        for i, sample in enumerate(samples):
            out[i, : sample[column].shape[0]] = sample[column]
        return out

    aux = padded(3, samples[0][3]) if len(samples[0]) > 3 else None  # [B, T, k * H]
    return TrainBatch(input_ids=padded(0, ids0), hidden=padded(1, hidden0), loss_mask=padded(2, mask0),
                      lengths=lengths.to(ids0.device), aux=aux)


@dataclass(frozen=True)
class HeadPairs:
    """The batch seen as head input pairs t = 0..T-2 and their targets (see the module docstring)."""

    tokens: Tensor  # [B, T-1] input_ids[t+1]
    features: Tensor  # [B, T-1, H] hidden[t] (EAGLE-3: [B, T-1, k * H] aux[t], the head's input layers)
    targets: Tensor  # [B, T-1, H] hidden[t+1]
    positions: Tensor  # [B, T-1] rotary position t
    weight: Tensor  # [B, T-1] bool: loss_mask[t+1] == 1 and t + 1 < length


def head_pairs(batch: TrainBatch) -> HeadPairs:
    """The one place the alignment of the module docstring is written down in code."""
    b, t = batch.input_ids.shape
    nxt = torch.arange(1, t, device=batch.input_ids.device)  # [T-1] position t+1
    real = nxt[None] < batch.lengths[:, None]  # [B, T-1]
    return HeadPairs(
        tokens=batch.input_ids[:, 1:],  # [B, T-1]
        features=(batch.hidden if batch.aux is None else batch.aux)[:, :-1],  # [B, T-1, H] (or [B, T-1, k * H])
        targets=batch.hidden[:, 1:],  # [B, T-1, H]
        positions=(nxt - 1).expand(b, t - 1),  # [B, T-1]
        weight=(batch.loss_mask[:, 1:] != 0) & real,  # [B, T-1]
    )


# ---- configuration and results ---------------------------------------------------------------
@dataclass(frozen=True)
class Eagle2Config:
    """EAGLE-2 objective: feature_weight * SmoothL1 + token_weight * soft cross-entropy.

    noise_width: the true input features get noise uniform on [-width/2, width/2) (targets are
    never noised). The EAGLE reference (AddUniformNoise, std 0.2) draws (U[0,1) - 0.5) * std *
    512 / seq_len: width 0.2 at 512 tokens, wider for shorter sequences. The project keeps the
    width fixed (default 0.2, the reference's at 512 tokens) so it does not depend on length.
    Set 0 for evaluation; inference never calls these losses.

    top1: compute the top-1 agreement metric (an argmax over the vocabulary per step, ~9% of a
    HASS step on a CPU); training steps skip it (NaN), evaluation needs it. The loss is the same.

    compile: run the vocabulary-sized terms (log-softmax, soft cross-entropy, top-K distillation)
    through torch.compile, which fuses their passes over [positions, vocabulary] into one kernel.
    The same loss up to float summation order; those passes are about half of a HASS step on a CPU
    (`python bench/train_speed.py --compile` measures it side by side). Needs a C++ compiler on the
    CPU (Triton on GPUs) and compiles once per process.
    """

    feature_weight: float = 1.0
    token_weight: float = 0.1
    noise_width: float = 0.2
    top1: bool = True
    compile: bool = False

    def __post_init__(self) -> None:
        for name in ("feature_weight", "token_weight", "noise_width"):
            if getattr(self, name) < 0:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class HassConfig(Eagle2Config):
    """HASS objective: the EAGLE-2 terms plus topk_weight * top-K distillation, at each of `steps`
    harmonized context alignment steps, all added."""

    topk: int = 10
    topk_weight: float = 1.0
    steps: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.topk < 1 or self.steps < 1:
            raise ValueError(f"HassConfig needs topk >= 1 and steps >= 1, got topk={self.topk}, steps={self.steps}")
        if self.topk_weight < 0:
            raise ValueError(f"HassConfig.topk_weight must be >= 0, got {self.topk_weight}")


@dataclass(frozen=True)
class Eagle3Config:
    """EAGLE-3's training-time test: `steps` forward passes unrolled, step j fed the head's own
    outputs of step j-1 under the attention inference would use (`alignment_mask`), a token loss
    at every step weighted step_decay ** (j-1), and no feature regression. The defaults are the
    reference's (7 steps, 0.8). `detach`: cut the gradient between steps as HASS does (the
    reference lets it flow). No input noise: the reference adds none.

    feature_weight: adds feature_weight * SmoothL1(norm(step-1 output), true next feature) to the
    first step's term, an experiment beyond the reference (default 0: none). EAGLE-2 supervises
    every position densely through its feature regression; EAGLE-3 drops it, and on SmolLM2 its
    depth-1 top-1 lags EAGLE-2's most (docs/eagle3.md; weight 1 changed nothing). The term regresses
    the output *after* the head's own norm (what its LM head reads, and the target's last-layer
    feature is post-norm too), so the pre-norm output, the next level's input, stays free, and only
    step 1 carries it, so the deeper steps' training-time test is unchanged.

    The target's distribution is over the draft vocabulary, renormalised, as for the other
    backbones; the reference instead drops positions whose target argmax lies outside it, which
    needs the full [positions, V] LM head every step."""

    steps: int = 7
    step_decay: float = 0.8
    detach: bool = False
    top1: bool = True
    compile: bool = False
    noise_width: float = 0.0  # fixed: read by code that handles every backbone's config
    feature_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"Eagle3Config.steps must be >= 1, got {self.steps}")
        if self.feature_weight < 0:
            raise ValueError(f"Eagle3Config.feature_weight must be >= 0, got {self.feature_weight}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"Eagle3Config.step_decay must lie in (0, 1], got {self.step_decay}")
        if self.noise_width != 0:
            raise ValueError("EAGLE-3 training adds no input noise (noise_width must be 0)")


LossConfig = Eagle2Config | HassConfig | Eagle3Config


@dataclass(frozen=True)
class StepLoss:
    """One forward step's terms, each a mean over its counted positions."""

    feature: Tensor  # [] SmoothL1(predicted feature, true next feature), mean over H
    token: Tensor  # [] soft cross-entropy -sum_x q(x) log p(x)
    distill: Tensor  # [] top-K distillation -sum_{x in top-K of q} q(x) log p(x) (0 for EAGLE-2)
    top1: Tensor  # [] detached: fraction where argmax p == argmax q
    count: Tensor  # [] detached: counted positions


@dataclass(frozen=True)
class LossOutput:
    loss: Tensor  # [] the weighted sum the optimizer minimises
    steps: tuple[StepLoss, ...]  # one per forward step (a single one for EAGLE-2)

    @property
    def top1(self) -> Tensor:  # [] top-1 agreement at depth 1
        return self.steps[0].top1

    def metrics(self) -> dict[str, float]:
        """Plain floats for logging: `loss` and `<term>/<step>` for every step."""
        out = {"loss": float(self.loss.detach())}
        for j, step in enumerate(self.steps, start=1):
            for name in ("feature", "token", "distill", "top1"):
                out[f"{name}/{j}"] = float(getattr(step, name).detach())
        return out


# ---- shared pieces ---------------------------------------------------------------------------
def _require_frozen_shared(head: DraftHead) -> None:
    """The embedding and LM head are the target's, shared and frozen (docs/spec.md §1). If they required
    grad, every step would compute (and an optimizer might apply) a vocabulary-sized gradient."""
    embed, lm_head = head.shared
    if any(p.requires_grad for m in (embed, lm_head) for p in m.parameters()):
        raise ValueError("the target's embedding / LM head require grad; freeze the target first: "
                         "target.model.requires_grad_(False)")


def add_uniform_noise(features: Tensor, width: float, generator: torch.Generator | None,
                      noise: Tensor | None = None) -> Tensor:
    """features + U[-width/2, width/2) noise, drawn from `generator` (on the features' device).
    Regularises the head against the imperfect features it is fed when drafting.

    noise: precomputed U[-1/2, 1/2) draws [..., H] (scaled by width here) instead of the generator;
    the trainer draws them per sample, so the noise a sample gets does not depend on how samples
    are split across processes and micro-batches."""
    if width == 0:
        return features
    if noise is not None:
        return features + (noise * width).to(features.dtype)
    if generator is None:
        raise ValueError("noise_width > 0 needs a seeded torch.Generator; use noise_width=0 for evaluation")
    u = torch.rand(features.shape, generator=generator, device=features.device, dtype=torch.float32)  # [..., H]
    return features + ((u - 0.5) * width).to(features.dtype)  # [..., H]


@torch.no_grad()
def target_distribution(head: DraftHead, targets: Tensor) -> Tensor:  # [..., H] -> [..., V] (or [..., N])
    """softmax(lm_head(true feature)): the target's own next-token distribution, a constant. With
    a draft vocabulary, over its N tokens only, renormalised (the head's logits cover the same tokens)."""
    return torch.softmax(head.target_logits(targets).float(), dim=-1)


@torch.no_grad()
def target_argmax(head: DraftHead, targets: Tensor, q: Tensor) -> Tensor:  # [P, H], [P, V|N] -> [P] target ids
    """The target's greedy next token at each true feature: argmax q, or with a draft vocabulary
    the argmax of the target's FULL LM head (q covers only the draft tokens, and a target token
    the head cannot propose must count as a miss, not be hidden)."""
    if head.draft_ids is None:
        return q.argmax(-1)  # [P]
    _, lm_head = head.shared
    return lm_head(targets).argmax(-1)  # [P] over all V


def soft_target_terms(logits: Tensor, q: Tensor, top_q: Tensor | None, top_x: Tensor | None) -> tuple[Tensor, Tensor]:
    """Per position: the soft cross-entropy -sum_x q(x) log p(x) and the top-K distillation
    -sum_{x in top-K of q} q(x) log p(x) (0 without top_q/top_x), p = softmax(logits).

    logits [..., V] (any float dtype; computed in fp32), q [..., V], top_q / top_x [..., K];
    returns two [...] tensors. Kept free of anything but tensor maths so torch.compile can fuse it.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # [..., V]
    token = -(q * logp).sum(-1)  # [...]
    if top_x is None:
        return token, torch.zeros_like(token)
    return token, -(top_q * logp.gather(-1, top_x)).sum(-1)  # [...], [...]


_compiled_soft_target_terms = None


def _soft_terms(compiled: bool):
    """soft_target_terms, or its torch.compile'd twin (compiled on first use, once per process)."""
    global _compiled_soft_target_terms
    if not compiled:
        return soft_target_terms
    if _compiled_soft_target_terms is None:
        _compiled_soft_target_terms = torch.compile(soft_target_terms, dynamic=True)
    return _compiled_soft_target_terms


@dataclass(frozen=True)
class Teacher:
    """The target's side of a batch's loss terms, in one object because it depends on the true
    features only: computed once per batch and shared by every forward step (HASS scores all its
    steps against it), so no step repeats a vocabulary-sized pass."""

    targets: Tensor  # [B, T, H] true next features
    q: Tensor  # [B, T, V] (or [B, T, N]) the target's distribution softmax(lm_head(targets)) (target_distribution)
    topk: int | None = None  # K of the top-K distillation term; None: no distillation term
    q_top: tuple[Tensor, Tensor] | None = None  # (values, indices) of q's top-K, [B, T, K] each; None: from q
    q_argmax: Tensor | None = None  # [B, T] the target's argmax in target ids (target_argmax); None: argmax q
    draft_ids: Tensor | None = None  # [N] the head's draft vocabulary, which the logits and q are over


def step_terms(predicted: Tensor, logits: Tensor, teacher: Teacher, weight: Tensor, top1: bool = True,
               compiled: bool = False) -> StepLoss:
    """The per-step terms, averaged over positions where `weight` is True (pooled over the batch,
    as the EAGLE code does). Masked positions are selected out, not multiplied by 0, so garbage
    (even inf) there cannot leak into the mean.

    predicted [B, T, H], logits [B, T, V] head; weight [B, T] bool (any leading shape works, the
    same for all). top1=False leaves the agreement metric NaN (it does not enter the loss).
    compiled: the vocabulary-sized terms through torch.compile (Eagle2Config.compile). With the
    teacher's draft_ids, the head's argmax is mapped to a target id and compared with q_argmax,
    which must then be given in target ids (target_argmax).
    """
    targets, q, topk, draft_ids = teacher.targets, teacher.q, teacher.topk, teacher.draft_ids
    count = weight.sum()  # []
    denom = count.clamp(min=1).float()  # []

    def mean(per_position: Tensor) -> Tensor:  # [B, T] -> []
        return torch.where(weight, per_position, torch.zeros_like(per_position)).sum() / denom

    feature = F.smooth_l1_loss(predicted.float(), targets.float(), reduction="none").mean(-1)  # [B, T]
    top_q = top_x = None
    if topk is not None:
        top = teacher.q_top if teacher.q_top is not None else q.topk(min(topk, q.shape[-1]), dim=-1)
        top_q, top_x = top  # [B, T, K] x2
    token, per_distill = _soft_terms(compiled)(logits, q, top_q, top_x)  # [B, T] x2
    distill = torch.zeros((), device=logits.device) if topk is None else mean(per_distill)  # []
    if top1:
        if draft_ids is not None and teacher.q_argmax is None:
            raise ValueError("step_terms over a draft vocabulary needs q_argmax in target ids (target_argmax)")
        guess = logits.argmax(-1) if draft_ids is None else draft_ids[logits.argmax(-1)]  # [B, T] target ids
        truth = q.argmax(-1) if teacher.q_argmax is None else teacher.q_argmax  # [B, T] target ids
        agree = mean((guess == truth).float()).detach()  # []
    else:
        agree = torch.full((), float("nan"), device=logits.device)  # []
    return StepLoss(feature=mean(feature), token=mean(token), distill=distill, top1=agree, count=count.detach())


def _weighted(step: StepLoss, cfg: LossConfig, index: int = 0) -> Tensor:  # []
    """Step `index` (0-based)'s share of the loss under the backbone's objective."""
    if isinstance(cfg, Eagle3Config):
        feature = cfg.feature_weight * step.feature if index == 0 and cfg.feature_weight else 0.0
        return cfg.step_decay ** index * step.token + feature
    topk_weight = cfg.topk_weight if isinstance(cfg, HassConfig) else 0.0
    return cfg.feature_weight * step.feature + cfg.token_weight * step.token + topk_weight * step.distill


# ---- EAGLE-2 ---------------------------------------------------------------------------------
def eagle2_loss(head: DraftHead, batch: TrainBatch, cfg: Eagle2Config = Eagle2Config(),
                generator: torch.Generator | None = None, noise: Tensor | None = None) -> LossOutput:
    """One causal forward of the head over the noised true features (docs/spec.md §6, EAGLE-2).
    noise: optional precomputed U[-1/2, 1/2) draws [B, T-1, H] (see add_uniform_noise)."""
    _require_frozen_shared(head)
    pairs = head_pairs(batch)
    features = add_uniform_noise(pairs.features, cfg.noise_width, generator, noise)  # [B, T-1, H]
    b, t = pairs.tokens.shape
    mask = causal_block_mask(t, 0, features.dtype, features.device).expand(b, 1, t, t)  # [B, 1, T-1, T-1]
    predicted = head(pairs.tokens, features, pairs.positions, mask)  # [B, T-1, H]
    w = pairs.weight  # [B, T-1]: the LM head (the dominant cost at small hidden sizes) runs only where a loss is taken
    targets = pairs.targets[w]  # [P, H]
    q = target_distribution(head, targets)  # [P, V] (or [P, N])
    q_argmax = target_argmax(head, targets, q) if cfg.top1 else None  # [P] target ids
    teacher = Teacher(targets, q, q_argmax=q_argmax, draft_ids=head.draft_ids)
    picked = predicted[w]  # [P, H]
    step = step_terms(picked, head.logits(picked), teacher, torch.ones_like(w[w]), cfg.top1, cfg.compile)
    return LossOutput(loss=_weighted(step, cfg), steps=(step,))


# ---- HASS ------------------------------------------------------------------------------------
def alignment_mask(step: int, length: int, dtype: torch.dtype, device) -> Tensor:
    """Additive mask [1, 1, T, step * T] for step `step` over the key rows of steps 1..step, laid
    out step-major (rows of step s at s*T - T .. s*T - 1, as the cache appends them).

    Query t sees key p iff p <= t, and then exactly one row: that of step max(1, step - (t - p)).
    Step 1 is plain causal attention.
    """
    t = torch.arange(length, device=device)  # [T]
    lag = t[:, None] - t[None, :]  # [T, T] query minus key position
    source = (step - lag).clamp(min=1)  # [T, T] the step whose row query t reads at key p
    steps = torch.arange(1, step + 1, device=device)  # [S]
    visible = (lag >= 0)[:, None, :] & (source[:, None, :] == steps[None, :, None])  # [T, S, T]
    mask = torch.zeros(length, step * length, dtype=dtype, device=device)  # [T, S*T]
    mask.masked_fill_(~visible.reshape(length, step * length), torch.finfo(dtype).min)
    return mask[None, None]  # [1, 1, T, S*T]


def aligned_outputs(head: DraftHead, tokens: Tensor, features: Tensor, positions: Tensor, steps: int,
                    detach: bool = True, dense: bool = False) -> list[Tensor]:
    """Head outputs of alignment steps 1..steps, each [B, T, H].

    tokens [B, T], features [B, T, H] (true, possibly noised; EAGLE-3: already fused), positions
    [B, T]. Step j's input at t > 0 is step j-1's output at t-1, DETACHED (HASS; `detach=False`
    for EAGLE-3's reference): the head learns to use its own features, but no
    gradient flows back through a predicted feature into the step that produced it. (Gradients
    do reach the parameters through the earlier steps' key/value rows, as they are functions of
    the parameters at inference too.) Position 0 keeps its true feature; step j's rows at t < j-1
    then recompute step t+1's rows exactly (there is no context of c >= 1 pairs behind them).

    The attention is `alignment_mask`'s, run as band attention (train/band_attention.py: each
    step costs what step 1 costs); `dense=True` runs the library's attention over every step's
    rows under the dense mask instead (the reference the band is tested against).
    """
    b, t = tokens.shape
    outputs: list[Tensor] = []
    inputs = features  # [B, T, H]
    rows = AlignedRows()  # key/value rows of every step so far, [B, kv_heads, T, head_dim] each
    cache = kv.new_cache() if dense else None  # dense: [B, kv_heads, j*T, head_dim] per layer
    with contextlib.nullcontext() if dense else band_attention_in(head):
        for step in range(1, steps + 1):
            if dense:
                mask = alignment_mask(step, t, features.dtype, features.device).expand(b, 1, t, step * t)  # [B, 1, T, j*T]
                outputs.append(head(tokens, inputs, positions, mask, cache))  # [B, T, H]
            else:
                rows.step = step
                outputs.append(head(tokens, inputs, positions, None, None, **{BAND_KWARG: rows}))  # [B, T, H]
            previous = outputs[-1][:, :-1].detach() if detach else outputs[-1][:, :-1]  # [B, T-1, H]
            inputs = torch.cat([features[:, :1], previous], dim=1)  # [B, T, H]
    return outputs


def hass_loss(head: DraftHead, batch: TrainBatch, cfg: HassConfig = HassConfig(),
              generator: torch.Generator | None = None, noise: Tensor | None = None) -> LossOutput:
    """EAGLE-2 terms + top-K distillation at each harmonized context alignment step, added
    (docs/spec.md §6, HASS). Step j counts positions t >= j-1 only: the others repeat a lower step.
    noise: optional precomputed U[-1/2, 1/2) draws [B, T-1, H] (see add_uniform_noise)."""
    _require_frozen_shared(head)
    pairs = head_pairs(batch)
    features = add_uniform_noise(pairs.features, cfg.noise_width, generator, noise)  # [B, T-1, H]
    return _aligned_loss(head, pairs, features, cfg, topk=cfg.topk, detach=True)


def _aligned_loss(head: DraftHead, pairs: HeadPairs, inputs: Tensor, cfg: "HassConfig | Eagle3Config",
                  topk: int | None, detach: bool, regressed=lambda out: out) -> LossOutput:
    """The terms of `cfg.steps` aligned steps over inputs [B, T-1, H], each scored against the
    target's distribution at the true next feature (shared by HASS and EAGLE-3). `regressed`
    maps a step's output [P, H] to what the feature term compares with the true next feature."""
    outputs = aligned_outputs(head, pairs.tokens, inputs, pairs.positions, cfg.steps, detach)
    w = pairs.weight  # [B, T-1]: logits only where step 1 takes a loss; later steps take subsets of those
    targets = pairs.targets[w]  # [P, H]
    q = target_distribution(head, targets)  # [P, V] (or [P, N])
    t = torch.arange(pairs.tokens.shape[1], device=inputs.device).expand_as(w)[w]  # [P] position of each pick
    # top-K once, for every step (draft indices with a draft vocabulary)
    q_top = q.topk(min(topk, q.shape[-1]), dim=-1) if topk is not None else None
    q_argmax = target_argmax(head, targets, q) if cfg.top1 else None  # [P] target ids
    teacher = Teacher(targets, q, topk, q_top, q_argmax, head.draft_ids)
    terms = tuple(step_terms(regressed(out[w]), head.logits(out[w]), teacher, t >= j - 1, cfg.top1, cfg.compile)
                  for j, out in enumerate(outputs, start=1))
    return LossOutput(loss=torch.stack([_weighted(s, cfg, j) for j, s in enumerate(terms)]).sum(), steps=terms)


# ---- EAGLE-3 ----------------------------------------------------------------------------------
def eagle3_loss(head: DraftHead, batch: TrainBatch, cfg: Eagle3Config = Eagle3Config(),
                generator: torch.Generator | None = None, noise: Tensor | None = None) -> LossOutput:
    """Training-time test (Eagle3Config): the head fuses the target's layers once, then runs
    `steps` aligned steps (the HASS alignment above: step j sees its own earlier outputs exactly
    as drafting at depth j does); each step's soft cross-entropy against the target's
    distribution, weighted step_decay ** (j-1), is summed. The teacher is the target's LM head at
    the true last-layer feature (batch.hidden), not the head's own LM head."""
    _require_frozen_shared(head)
    if batch.aux is None:
        raise ValueError("EAGLE-3 trains on the target's low / middle / high layers: extract the features with "
                         "`taps features --aux-layers auto`")
    if noise is not None:
        raise ValueError("EAGLE-3 training adds no input noise")
    pairs = head_pairs(batch)
    return _aligned_loss(head, pairs, head.fuse(pairs.features), cfg, topk=None, detach=cfg.detach,
                         regressed=head.norm)  # the feature term reads the normed output (Eagle3Config)


# ---- pooling over processes and micro-batches ---------------------------------------------------
def counted_positions(batch: TrainBatch, steps: int) -> Tensor:  # [steps] long
    """Positions each step counts in `batch`, known before any forward (from the masks alone)."""
    weight = head_pairs(batch).weight  # [B, T-1]
    t = torch.arange(weight.shape[1], device=weight.device)  # [T-1]
    return torch.stack([(weight & (t >= j - 1)[None]).sum() for j in range(1, steps + 1)])


def pooled_loss(out: LossOutput, cfg: LossConfig, totals: Tensor) -> Tensor:  # []
    """This micro-batch's share of the loss averaged over ALL counted positions of the optimizer
    step (totals [steps], summed over every micro-batch of every process). Summing the gradients
    of these shares gives exactly the gradient of one big batch, however it is split."""
    shares = [_weighted(s, cfg, j) * s.count / totals[j].clamp(min=1) for j, s in enumerate(out.steps)]
    return torch.stack(shares).sum()
