"""Draft vocabularies (EAGLE-3 / SGLang): the N target tokens a head drafts over, chosen as the
most frequent tokens its training data asks it to predict; and `taps drafter reduce-vocab`, which
gives an existing head such a vocabulary.

Why: the vocabulary-sized terms (the LM head over all V tokens) dominate a draft step and a
training step at large V; the draft tokens the verifier accepts are overwhelmingly frequent ones.
A head over N << V tokens stays lossless (verification never depends on the draft distribution);
it can only never propose the other V - N tokens.

What is counted: the tokens the training loss is about. Pair t counts iff loss_mask[t+1] == 1 and
t + 1 < length (train/losses.py, head_pairs), and its target distribution is over the token at
t + 2. So a record contributes input_ids[p + 1] for every position p >= 1 with loss_mask[p] != 0
and p + 1 < length (the last position's distribution has no next token in the data). Ties are
broken by token id, lower first; `always` tokens (the target's stop tokens) are taken first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from taps.data.features import FeatureSet
from taps.drafter.checkpoint import pop_draft_vocab, read_config, read_weights, write_drafter
from taps.drafter.layouts import family_of_checkpoint
from taps.core.outputs import check_output_dir


@dataclass(frozen=True)
class DraftVocab:
    ids: Tensor  # [N] long target ids, ascending
    coverage: float  # share of the counted tokens inside the vocabulary
    counted: int  # tokens counted


def check_size(size: int, vocab_size: int) -> None:
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must be between 1 and the target's vocabulary size "
                         f"{vocab_size}")


def _shard_counts(ids: Tensor, mask: Tensor, offsets: Tensor, chosen: Tensor, max_len: int | None,
                  vocab_size: int) -> Tensor:  # [V] long
    """Counts of one shard's loss tokens (module docstring), over the records where `chosen` [R]."""
    lengths = offsets.diff()  # [R]
    total = int(offsets[-1])
    rec = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)  # [N] record of each token
    pos = torch.arange(total) - offsets[:-1][rec]  # [N] position within its record
    used = lengths.clamp(max=max_len) if max_len is not None else lengths  # [R] tokens the trainer reads
    counted = (mask[:total] != 0) & (pos >= 1) & (pos + 1 < used[rec]) & chosen[rec]  # [N]
    tokens = ids[1:total].long()[counted[: total - 1]]  # [C] input_ids[p + 1]
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        raise ValueError(f"features hold token id {int(tokens.max())}, outside the target's vocabulary of "
                         f"{vocab_size}: they were made for another target")
    return torch.bincount(tokens, minlength=vocab_size)  # [V]


def loss_token_counts(features: FeatureSet, vocab_size: int, records: Iterable[int] | None = None,
                      max_len: int | None = None) -> Tensor:  # [V] long
    """How often each target token is a training target (module docstring), over `records` (global
    indices of the feature set; all when None), each record cut to max_len tokens as training does."""
    wanted = None if records is None else torch.tensor(sorted(set(records)), dtype=torch.long)  # [K]
    counts = torch.zeros(vocab_size, dtype=torch.long)  # [V]
    for first, ids, mask, offsets in features.token_arrays():
        n_rec = offsets.numel() - 1
        chosen = torch.ones(n_rec, dtype=torch.bool)  # [R]
        if wanted is not None:
            local = wanted[(wanted >= first) & (wanted < first + n_rec)] - first
            chosen = torch.zeros(n_rec, dtype=torch.bool).index_fill_(0, local, True)
        counts += _shard_counts(ids, mask, offsets, chosen, max_len, vocab_size)
    return counts


def select_draft_vocab(counts: Tensor, size: int, always: Sequence[int] = ()) -> Tensor:  # [V] -> [N] ascending
    """The `size` most frequent tokens (ties: lower id first), the `always` tokens taken first."""
    check_size(size, counts.numel())
    key = counts.double().clone()  # [V]
    keep = [i for i in dict.fromkeys(int(t) for t in always) if 0 <= i < counts.numel()]
    if keep:
        key[torch.tensor(keep)] = float("inf")
    order = torch.sort(key, descending=True, stable=True).indices  # [V] equal counts stay in id order
    return order[:size].sort().values  # [N]


def coverage(counts: Tensor, draft_ids: Tensor) -> float:
    """Share of the counted tokens that fall inside the draft vocabulary."""
    total = int(counts.sum())
    if total == 0:
        raise ValueError("the features hold no assistant (loss) tokens to count: no draft vocabulary can be chosen")
    return int(counts[draft_ids].sum()) / total


def choose_draft_vocab(features: FeatureSet, vocab_size: int, size: int, records: Iterable[int] | None = None,
                       max_len: int | None = None, always: Sequence[int] = ()) -> DraftVocab:
    check_size(size, vocab_size)
    counts = loss_token_counts(features, vocab_size, records, max_len)  # [V]
    ids = select_draft_vocab(counts, size, always)  # [N]
    return DraftVocab(ids=ids, coverage=coverage(counts, ids), counted=int(counts.sum()))


def reduce_vocab(drafter: str | Path, features: Sequence[str], size: int, out_dir: str | Path,
                 force: bool = False) -> tuple[Path, DraftVocab]:
    """`taps drafter reduce-vocab`: a copy of a drafter that drafts over the `size` most frequent
    loss tokens of `features` (specs DIR or DIR:LIMIT, all records, no length cut). The weights are
    copied unchanged: none depends on the vocabulary. A head that already has a draft vocabulary
    gets the new one instead. The target's stop tokens are not known here (no target is loaded).
    `out_dir` is never `drafter`; a drafter already there is replaced only with `force`."""
    drafter = Path(drafter)
    check_output_dir(out_dir, "drafter", force=force, inputs=[("--drafter", drafter)])
    config, info = read_config(drafter)
    tensors = read_weights(drafter)
    if family_of_checkpoint(config, tensors) == "eagle3":  # by its architecture or its midlayer tensors
        raise ValueError(f"{drafter}: an EAGLE-3 head's own LM head fixes its draft vocabulary (one row per token); "
                         "train a new head with --draft-vocab N instead")
    check_size(size, int(config["vocab_size"]))
    pop_draft_vocab(tensors, config, drafter)  # checked, then replaced
    shards = FeatureSet.from_specs(list(features), fingerprint=info.tokenizer_fingerprint)
    if shards.hidden_size != config["hidden_size"]:
        raise ValueError(f"{shards.description}: features of hidden size {shards.hidden_size}, the drafter's is "
                         f"{config['hidden_size']}: they belong to another target")
    vocab = choose_draft_vocab(shards, int(config["vocab_size"]), size)
    info.extra = {**info.extra, "draft_vocab_coverage": round(vocab.coverage, 6),
                  "draft_vocab_features": shards.description}
    return write_drafter(out_dir, config, tensors, info, vocab.ids), vocab
