"""Weight averaging of drafter heads (docs/spec.md §4, "Averaged"): theta = sum_i w_i * theta_i.

Every head parameter is averaged (weights non-negative, summing to 1), in float64, then cast back
to the first head's dtype. Heads must agree on every key and shape and on the config fields that
define the computation (sizes, rope, norm epsilon, activation, fc bias); checkpoints must also
carry the same target tokenizer fingerprint. Anything else is an error naming what differs.

lambda_sweep gives the paper's Figure 6 interpolation lambda * A + (1 - lambda) * B.

Draft vocabularies (drafter/head.py) may differ. An EAGLE-2 / HASS head has no weight that depends
on them (the LM head is the target's), so they are not averaged; the average drafts over the union
of the members' draft vocabularies, or over the full vocabulary if any member does. An EAGLE-3
head has its own LM head over its draft vocabulary: heads with the same vocabulary average row by
row; heads with different ones average over the union of the vocabularies of the heads with a
positive weight, each token's row the weighted average of the rows of the heads that have it
(their weights renormalised over them; `union_lm_head`). No row is invented for a head that lacks
a token: a head's hidden space was trained only against its own rows, so a stand-in row (the
target's, where TAPS starts every row) scores tokens it never learned to rank. Widened that way,
eagle3-math and eagle3-chat averaged drafted almost nothing (1.03-1.36 tokens per call on six
questions where their members take 1.3-4.0); averaged over the rows that exist, 1.42-2.56
(docs/eagle3.md).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from taps.drafter.checkpoint import DrafterInfo, pop_draft_vocab, read_config, read_weights, write_drafter
from taps.drafter.layouts import family_of_checkpoint
from taps.drafter.head import EagleHead
from taps.drafter.head3 import Eagle3Head
from taps.drafter.mix_weights import AverageError, check_weights
from taps.core.outputs import check_output_dir

# config fields two heads must share to be averaged (rope is compared through rope_theta)
MATCHING_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "vocab_size", "rms_norm_eps", "hidden_act", "target_hidden_size", "eagle_aux_hidden_state_layer_ids")
LM_HEAD = "lm_head.weight"  # an EAGLE-3 head's own LM head, [draft vocabulary, hidden]
DEFAULT_LAMBDAS = tuple(round(0.1 * i, 10) for i in range(1, 10))  # 0.1 .. 0.9


def average_state_dicts(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float] | None = None,
                        names: Sequence[str] | None = None) -> dict[str, Tensor]:
    """sum_i w_i * states[i][key] for every key; keys and shapes must agree exactly."""
    weights = check_weights(weights, len(states))
    names = list(names) if names is not None else [f"head {i}" for i in range(len(states))]
    first = states[0]
    for name, state in zip(names[1:], states[1:]):
        missing, extra = sorted(set(first) - set(state)), sorted(set(state) - set(first))
        if missing or extra:
            detail = "; ".join(x for x in (f"missing {', '.join(missing)}" if missing else "",
                                           f"unexpected {', '.join(extra)}" if extra else "") if x)
            raise AverageError(f"{name} does not have the keys of {names[0]}: {detail}")
        for key, value in first.items():
            if tuple(state[key].shape) != tuple(value.shape):
                raise AverageError(f"key {key}: {names[0]} has shape {tuple(value.shape)}, "
                                   f"{name} has {tuple(state[key].shape)}")
    out = {}
    for key, value in first.items():
        acc = torch.zeros(value.shape, dtype=torch.float64, device=value.device)
        for w, state in zip(weights, states):
            acc += w * state[key].to(device=value.device, dtype=torch.float64)
        out[key] = acc.to(value.dtype)
    return out


def union_draft_vocab(draft_ids: Sequence[Tensor | None]) -> Tensor | None:
    """The union of draft vocabularies ([N] ascending target ids), None if any is the full one."""
    if any(ids is None for ids in draft_ids):
        return None
    return torch.unique(torch.cat([ids.cpu() for ids in draft_ids]))  # [N] sorted


def _rope_theta(config: Mapping) -> float | None:
    rope = config.get("rope_parameters") or {}
    return rope.get("rope_theta", config.get("rope_theta"))


def check_configs(configs: Sequence[Mapping], names: Sequence[str]) -> None:
    """The fields that define a head's computation must agree (None = not given, not compared)."""
    first = configs[0]
    for name, config in zip(names[1:], configs[1:]):
        for key in MATCHING_FIELDS:
            a, b = first.get(key), config.get(key)
            if a is not None and b is not None and a != b:
                raise AverageError(f"config {key}: {names[0]} has {a!r}, {name} has {b!r}")
        a, b = _rope_theta(first), _rope_theta(config)
        if a is not None and b is not None and float(a) != float(b):
            raise AverageError(f"config rope_theta: {names[0]} has {a!r}, {name} has {b!r}")


def average_heads(heads: Sequence[EagleHead], weights: Sequence[float] | None = None) -> EagleHead:
    """A new head with the weighted average of the heads' parameters, on the first head's device
    and dtype, bound to the same target embedding / LM head as the first (if it is bound)."""
    heads = list(heads)
    weights = check_weights(weights, len(heads))
    names = [f"head {i}" for i in range(len(heads))]
    for name, head in zip(names[1:], heads[1:]):
        if type(head) is not type(heads[0]):
            raise AverageError(f"averaging stays within one backbone: head 0 is {_kind(heads[0])}, {name} is "
                               f"{_kind(head)}; their weights do not mean the same thing")
        if head.bias != heads[0].bias:
            raise AverageError(f"fc bias: head 0 has bias={heads[0].bias}, {name} has bias={head.bias}")
    eagle3 = isinstance(heads[0], Eagle3Head)
    check_configs([h.config.to_dict() for h in heads], names)
    states, draft_ids = [h.state_dict() for h in heads], union_draft_vocab([h.draft_ids for h in heads])
    lm_head = None
    if eagle3:  # each has its own LM head: row i must be the same token in every head
        same = all(_same_ids(h.draft_ids, heads[0].draft_ids) for h in heads[1:])
        draft_ids = heads[0].draft_ids if same else draft_ids
        if not same:
            ids = [_vocab_ids(h.draft_ids, int(h.config.vocab_size)) for h in heads]
            draft_ids, lm_head = union_lm_head([s[LM_HEAD] for s in states], ids, weights)
            states = [{k: v for k, v in s.items() if k != LM_HEAD} for s in states]
    state = average_state_dicts(states, weights, names)
    if lm_head is not None:
        state[LM_HEAD] = lm_head.to(heads[0].lm_head.weight.dtype)
    ref = next(heads[0].parameters())
    if eagle3:
        config = copy.deepcopy(heads[0].config)
        config.draft_vocab_size = int(state["lm_head.weight"].shape[0])
        out = Eagle3Head(config)
    else:
        out = EagleHead(copy.deepcopy(heads[0].config), bias=heads[0].bias)
    out.load_state_dict(state, strict=True)
    out = out.to(device=ref.device, dtype=ref.dtype).eval()
    out.set_draft_vocab(draft_ids)
    if heads[0].is_bound:
        out.share_target(heads[0])
    return out


def _vocab_ids(draft_ids: Tensor | None, vocab_size: int) -> Tensor:  # [N] target ids of the LM head's rows
    return torch.arange(vocab_size) if draft_ids is None else draft_ids.cpu()


@torch.no_grad()
def union_lm_head(rows: Sequence[Tensor], ids: Sequence[Tensor], weights: Sequence[float]) -> tuple[Tensor, Tensor]:
    """EAGLE-3 LM heads over different draft vocabularies averaged: (union [U] ascending target
    ids, rows [U, H] in float64). The union covers the tokens of the heads with a positive weight
    (a head weighted 0 adds nothing, its vocabulary included); a token's row is sum_i w_i * row_i
    over the heads i that have it, divided by the sum of their w_i (module docstring: why no
    stand-in row for the others). rows[i] is [N_i, H], ids[i] its [N_i] target ids in row order."""
    kept = [i for i, w in enumerate(weights) if w > 0]
    union = torch.unique(torch.cat([ids[i] for i in kept]))  # [U] sorted
    total = torch.zeros(union.numel(), rows[kept[0]].shape[1], dtype=torch.float64)  # [U, H]
    mass = torch.zeros(union.numel(), 1, dtype=torch.float64)  # [U, 1]: the weight of the heads with each token
    for i in kept:
        at = torch.searchsorted(union, ids[i])  # [N_i]: its rows' places in the union
        total[at] += weights[i] * rows[i].detach().cpu().to(torch.float64)
        mass[at] += weights[i]
    return union, total / mass


def _kind(head) -> str:
    return "an EAGLE-3 head" if isinstance(head, Eagle3Head) else "an EAGLE-2 / HASS head"


def _same_ids(a: Tensor | None, b: Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a.cpu(), b.cpu()))


def lambda_sweep(head_a: EagleHead, head_b: EagleHead,
                 lambdas: Sequence[float] = DEFAULT_LAMBDAS) -> Iterator[tuple[float, EagleHead]]:
    """(lambda, lambda * A + (1 - lambda) * B) for each lambda (paper Figure 6: 0.1 .. 0.9)."""
    for lam in lambdas:
        if not 0.0 <= lam <= 1.0:
            raise AverageError(f"lambda must be in [0, 1], got {lam}")
        yield lam, average_heads([head_a, head_b], [lam, 1.0 - lam])


# ---- checkpoints ---------------------------------------------------------------------------------
def average_checkpoints(paths: Sequence[str | Path], out_dir: str | Path, weights: Sequence[float] | None = None,
                        names: Sequence[str] | None = None) -> Path:
    """`taps average`: write the weighted average of drafter checkpoints as a new drafter directory
    (EAGLE layout, loadable by load_head). The heads must share keys, shapes, the computation-
    defining config fields and the target tokenizer fingerprint."""
    paths = [Path(p) for p in paths]
    weights = check_weights(weights, len(paths))
    labels = [str(p) for p in paths]
    configs, infos = zip(*(read_config(p) for p in paths))
    tensors = [read_weights(p) for p in paths]
    kinds = [family_of_checkpoint(c, t) == "eagle3" for c, t in zip(configs, tensors)]  # by name or by its tensors
    if len(set(kinds)) > 1:
        other = labels[kinds.index(not kinds[0])]
        raise AverageError(f"averaging stays within one backbone: {labels[0]} is "
                           f"{'an EAGLE-3' if kinds[0] else 'an EAGLE-2 / HASS'} head, {other} is "
                           f"{'an EAGLE-3' if not kinds[0] else 'an EAGLE-2 / HASS'} head")
    check_configs(configs, labels)
    biases = [bool(c.get("bias", False)) for c in configs]
    if len(set(biases)) > 1:
        raise AverageError(f"config bias: {labels[0]} has {biases[0]}, "
                           f"{labels[biases.index(not biases[0])]} has {not biases[0]}")
    known = {i.tokenizer_fingerprint for i in infos if i.tokenizer_fingerprint is not None}
    if len(known) > 1:
        listing = ", ".join(f"{label}: {info.tokenizer_fingerprint}" for label, info in zip(labels, infos))
        raise AverageError(f"the drafters were trained for different target tokenizers ({listing})")
    if any(i.tokenizer_fingerprint is None for i in infos):
        warnings.warn("some drafters carry no taps.tokenizer_fingerprint (foreign checkpoints?); "
                      "their target could not be checked")
    vocabs = [pop_draft_vocab(t, c, p) for t, c, p in zip(tensors, configs, paths)]
    draft_ids, lm_head = vocabs[0] if kinds[0] else union_draft_vocab(vocabs), None
    if kinds[0] and not all(_same_ids(v, vocabs[0]) for v in vocabs[1:]):  # own LM heads over different tokens
        dtype = tensors[0][LM_HEAD].dtype
        ids = [_vocab_ids(v, int(c["vocab_size"])) for v, c in zip(vocabs, configs)]
        draft_ids, lm_head = union_lm_head([t[LM_HEAD] for t in tensors], ids, weights)
        tensors = [{k: v for k, v in t.items() if k != LM_HEAD} for t in tensors]
    state = average_state_dicts(tensors, weights, labels)
    config = dict(configs[0])
    if lm_head is not None:
        state[LM_HEAD] = lm_head.to(dtype)
        config["draft_vocab_size"] = int(lm_head.shape[0])

    names = list(names) if names is not None else [p.name for p in paths]
    backbones = sorted({i.backbone for i in infos})
    info = DrafterInfo(
        backbone=backbones[0] if len(backbones) == 1 else "+".join(backbones),
        training_data=" + ".join(f"{w:g}*{n}" for w, n in zip(weights, names)),
        target_name=infos[0].target_name,
        tokenizer_fingerprint=next(iter(known)) if known else None,
        extra={"averaged_from": [{"name": n, "path": str(p), "weight": w, "backbone": i.backbone,
                                  "training_data": i.training_data}
                                 for n, p, w, i in zip(names, paths, weights, infos)]})
    return write_drafter(out_dir, config, state, info, draft_ids)


def average_command(drafters: Sequence[tuple[str, str]], out: str | Path, weights: Sequence[float] | None = None,
                    sweep: bool = False, lambdas: Sequence[float] | None = None, force: bool = False) -> str:
    """`taps average`: the weighted average of named drafters (NAME, DIR) written to `out`, or with
    `sweep` lambda*A + (1-lambda)*B for two drafters under `out`; returns what was written. `out`
    (each sweep directory) is never one of the drafters, and a drafter there is replaced only with
    `force` (taps.core.outputs)."""
    names = [n for n, _ in drafters]
    paths = [d for _, d in drafters]
    inputs = [(f"--drafter {n}={d}", d) for n, d in drafters]
    for target in [Path(out) / sweep_dir_name(lam) for lam in lambdas or DEFAULT_LAMBDAS] if sweep else [out]:
        check_output_dir(target, "drafter", force=force, inputs=inputs)
    if len(paths) < 2:
        raise ValueError("taps average needs at least two --drafter")
    if len(set(names)) != len(names):
        raise ValueError(f"--drafter names must be distinct, got {', '.join(names)}; name them NAME=DIR")
    if sweep:
        if len(paths) != 2:
            raise ValueError(f"--sweep interpolates exactly two drafters, got {len(paths)}")
        if weights:
            raise ValueError("--sweep takes --lambdas, not --weight")
        outs = sweep_checkpoints(paths[0], paths[1], out, lambdas or DEFAULT_LAMBDAS, names)
        return f"wrote {len(outs)} averaged drafters lambda*{names[0]} + (1-lambda)*{names[1]} under {out}"
    if lambdas is not None:
        raise ValueError("--lambdas needs --sweep")
    written = average_checkpoints(paths, out, weights, names)
    weights = weights or [1.0 / len(paths)] * len(paths)
    return f"wrote {' + '.join(f'{w:g}*{n}' for w, n in zip(weights, names))} to {written}"


def sweep_dir_name(lam: float) -> str:
    return f"lambda-{lam:g}"


def sweep_checkpoints(path_a: str | Path, path_b: str | Path, out_root: str | Path,
                      lambdas: Sequence[float] = DEFAULT_LAMBDAS, names: Sequence[str] | None = None) -> list[Path]:
    """Write OUT_ROOT/lambda-<l> = l * A + (1 - l) * B for each lambda; returns the directories."""
    out_root = Path(out_root)
    outs = []
    for lam in lambdas:
        if not 0.0 <= lam <= 1.0:
            raise AverageError(f"lambda must be in [0, 1], got {lam}")
        outs.append(average_checkpoints([path_a, path_b], out_root / sweep_dir_name(lam), [lam, 1.0 - lam], names))
    return outs
