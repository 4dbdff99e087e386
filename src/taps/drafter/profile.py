"""Measured costs on this machine: the target's tree forward per node count and a draft level
per beam count, for one target, dtype and thread count (`taps profile`).

Speculative decoding pays when accepted tokens outrun what a tree costs, and what a tree costs
depends on the machine: on a GPU verifying 60 tokens costs about one token's forward, on a CPU
several (SmolLM2-135M, bf16, one thread: 58 ms for 1 token, 103 ms for 64). Cost-aware trees
and the benchmarks read these numbers instead of assuming them.

The verify cost also depends on how much context is committed (every tree node attends to all of
it), so the profile times tree forwards at several context lengths too (`verify_ms_by_context`:
128 to 2,048 tokens, what `--tree auto` reads for the step at hand), and splits a 16-node tree
forward into mask building, attention, cache append and everything else (`verify_split`), for
the tree attention the Target uses (taps.core.attention) and for the dense-mask path it replaced.

A profile is a small JSON file cached under `$TAPS_CACHE_DIR/profiles`, keyed by the machine
(CPU or GPU model, cores, torch version), the target, the dtype and the thread count (and the
drafter's weights when one is profiled); `measure=True` replaces it. Every figure is the median
of `repeats` interleaved rounds after a warm-up, so a noisy neighbour shifts all sizes alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from taps.core import attention, kv
from taps.core.config import SpeculationConfig
from taps.drafter.auto_tree import AutoTree, StepCosts
from taps.drafter.checkpoint import load_head
from taps.drafter.context import consume
from taps.drafter.head import DraftHead
from taps.core.jsonl import read_json, write_json_atomic
from taps.core.machine import machine
from taps.core.stopwatch import now
from taps.core.target import Target, TargetRef
from taps.core.targets import cache_root
from taps.core.tree import DraftTree, additive_mask

log = logging.getLogger(__name__)

# Every tree size up to 32 is timed, not a few with the others interpolated: a CPU's matmul kernels
# can favour row counts, so cost is not monotone in size (float32 on an AMD EPYC without AMX, after
# 200 tokens: 2 / 3 / 4 tree tokens 96 / 117 / 84 ms, 15 / 16 131 / 120 ms; docs/long-context.md), and
# `--tree auto` then verifies the sizes that run fast, filled with the next-best nodes.
TREE_SIZES = tuple(range(1, 33)) + (48, 64, 96, 128)
BEAM_SIZES = (1, 2, 4, 6, 8, 10, 16)
CONTEXTS = (128, 512, 1024, 2048)  # committed tokens at which verify costs are also measured
CONTEXT_SIZES = tuple(range(1, 33)) + (48, 64)  # tree sizes timed at each of those contexts
SPLIT_NODES = 16  # the tree size whose forward is split into its parts
# 6: linear weights packed (taps.core.packed); 5: every tree size to 32 (4 timed 1, 2, 4, 8, 12, ...); 4: trees
# on short contexts take the dense mask (3 timed them on the matmul path; 2 timed one-node forwards off the
# fused kernel)
FORMAT_VERSION = 6
SPEED_TOLERANCE = 0.30  # a one-token forward this much off the profile's means: measure again


def _random_tree(n: int, root: int, vocab: int, gen: torch.Generator, device) -> DraftTree:
    """n nodes, root included, each non-root node under a random earlier node (shape barely
    changes the cost: every node attends to the prefix and a handful of ancestors)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    tokens = [root] + torch.randint(0, vocab, (n - 1,), generator=gen).tolist()
    zeros = torch.zeros(n, device=device)
    return DraftTree.drafted(tokens=torch.tensor(tokens, device=device),
                             parents=torch.tensor(parents, device=device), logp=zeros, entropy=zeros, drafter=0)


def _prefixed(target: Target, prefix: int, gen: torch.Generator) -> None:
    target.reset()
    target.prefill(torch.randint(0, target.vocab_size, (prefix,), generator=gen))


def time_target(target: Target, sizes=TREE_SIZES, prefix: int = 200, repeats: int = 5, seed: int = 0) -> dict[int, float]:
    """Median ms of one tree forward of n nodes after a `prefix`-token context, for each n."""
    gen = torch.Generator().manual_seed(seed)
    _prefixed(target, prefix, gen)
    trees = {n: _random_tree(n, 1, target.vocab_size, gen, target.device) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for round_ in range(repeats + 1):  # round 0 warms up
        for n in sizes:
            t0 = now(target.device)
            target.forward_tree(trees[n])
            t1 = now(target.device)
            target.commit(torch.zeros(1, dtype=torch.long, device=target.device))
            target.truncate(prefix)
            if round_:
                times[n].append((t1 - t0) * 1e3)
    target.reset()
    return {n: statistics.median(v) for n, v in times.items()}


def usable_contexts(target: Target, contexts=CONTEXTS, sizes=CONTEXT_SIZES) -> tuple[int, ...]:
    """The contexts that leave room for the largest tree in the target's context window."""
    return tuple(c for c in contexts if c + max(sizes) <= target.context_window)


def time_contexts(target: Target, contexts=CONTEXTS, sizes=CONTEXT_SIZES, repeats: int = 5,
                  seed: int = 0) -> dict[int, dict[int, float]]:
    """Median ms of one tree forward of n nodes after c committed tokens, for each c and n."""
    return {c: time_target(target, sizes, prefix=c, repeats=repeats, seed=seed)
            for c in usable_contexts(target, contexts, sizes)}


SPLIT_PARTS = ("mask", "attention", "cache append", "other")


def verify_split(target: Target, context: int, nodes: int = SPLIT_NODES, repeats: int = 5,
                 seed: int = 0) -> dict[str, float]:
    """Median ms of one `nodes`-node tree forward after `context` committed tokens ("total"), and
    its parts: building the mask (Target.tree_inputs), attention (every layer's attention call),
    appending the new rows to the cache (every layer's cache update), and everything else
    (projections, MLPs, norms, the LM head, Python): the total less the other three."""
    gen = torch.Generator().manual_seed(seed)
    _prefixed(target, context, gen)
    tree = _random_tree(nodes, 1, target.vocab_size, gen, target.device)
    rows: list[dict[str, float]] = []
    for round_ in range(repeats + 1):  # round 0 warms up
        t0 = now(target.device)
        target.tree_inputs(tree, context)
        t1 = now(target.device)
        with attention.timed() as attend, kv.timed_updates(target.cache, target.device) as append:
            target.forward_tree(tree)
            t2 = now(target.device)
        target.commit(torch.zeros(1, dtype=torch.long, device=target.device))
        target.truncate(context)
        if round_:
            total, mask = (t2 - t1) * 1e3, (t1 - t0) * 1e3
            att, app = sum(attend) * 1e3, sum(append) * 1e3
            rows.append({"total": total, "mask": mask, "attention": att, "cache append": app,
                         "other": total - mask - att - app})
    target.reset()
    return {part: round(statistics.median(r[part] for r in rows), 3) for part in ("total", *SPLIT_PARTS)}


def split_by_path(target: Target, contexts, repeats: int = 5) -> dict[str, dict[str, dict[str, float]]]:
    """verify_split at each context, for the tree attention and (for comparison) the dense mask."""
    paths = {"tree attention": True, "dense mask": False} if target.tree_attention else {"dense mask": False}
    using = target.tree_attention
    try:
        out = {}
        for name, on in paths.items():
            target.tree_attention = on
            out[name] = {str(c): verify_split(target, c, repeats=repeats) for c in contexts}
        return out
    finally:
        target.tree_attention = using


@torch.inference_mode()
def time_draft_level(head, target: Target, beams=BEAM_SIZES, prefix: int = 200, repeats: int = 5,
                     seed: int = 0) -> dict[int, float]:
    """Median ms of one draft level for k beams: the head's forward over k nodes (each attending
    to the context and itself), its LM head over k rows, log-softmax and top-k."""
    gen = torch.Generator().manual_seed(seed)
    device = target.device
    features = torch.randn(prefix, target.hidden_size, generator=gen).to(device, target.dtype)  # [P, H]
    ctx = consume(head, None, torch.randint(0, target.vocab_size, (prefix,), generator=gen), features)
    times: dict[int, list[float]] = {k: [] for k in beams}
    for round_ in range(repeats + 1):
        for k in beams:
            tokens = torch.randint(0, target.vocab_size, (1, k), generator=gen).to(device)  # [1, k]
            feats = features[torch.arange(k, device=device) % prefix][None]  # [1, k, H]
            mask = additive_mask(torch.eye(k, dtype=torch.bool, device=device), None, ctx.length, None, feats.dtype)
            positions = torch.full((1, k), ctx.length, dtype=torch.long, device=device)
            t0 = now(device)
            hidden = head(tokens, feats, positions, mask, ctx.cache)[0]  # [k, H]
            logp = torch.log_softmax(head.logits(hidden).float(), dim=-1)  # [k, V]
            logp.topk(min(10, logp.shape[-1]), dim=-1)
            t1 = now(device)
            kv.truncate(ctx.cache, ctx.length)
            if round_:
                times[k].append((t1 - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def profile_path(target_name: str, dtype: str, threads: int, drafter_digest: str | None = None,
                 root: Path | None = None) -> Path:
    key = json.dumps({"machine": machine(), "target": target_name, "dtype": dtype, "threads": threads,
                      "drafter": drafter_digest}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(target_name).name or "target")
    return (root or cache_root() / "profiles") / f"{safe}-{dtype}-t{threads}-{digest}.json"


def speed_changed(now_ms: float, profiled_ms: float, tolerance: float = SPEED_TOLERANCE) -> bool:
    """Whether a forward that takes now_ms here, profiled at profiled_ms, says the machine's
    speed is no longer the profile's (another load on it, a changed clock or thread count)."""
    return abs(now_ms / profiled_ms - 1.0) > tolerance


def check_speed(target: Target, cached: dict, path: Path) -> dict:
    """Re-time a one-token forward (3 rounds, at the profile's context) against the cached
    profile's; log a warning to re-measure when it is more than SPEED_TOLERANCE off twice running
    (the second time over 5 rounds): one moment's timing, a process's first forwards or a burst of
    load beside it, is not the machine's speed (session 38 saw a false warning at 84.5 against
    59.8 ms). Only at start-up: a Target that already holds a context is left alone (timing would
    reset it)."""
    profiled = float(cached["target_forward_ms"]["1"])
    if target.length:
        return {"profiled_ms": profiled, "changed": None}
    prefix = int(cached.get("prefix_tokens", 200))
    now_ms = time_target(target, sizes=(1,), prefix=prefix, repeats=3)[1]
    changed = speed_changed(now_ms, profiled)
    if changed:  # confirm before telling anyone to re-measure
        now_ms = time_target(target, sizes=(1,), prefix=prefix, repeats=5)[1]
        changed = speed_changed(now_ms, profiled)
    if changed:
        log.warning(f"taps profile: a one-token forward takes {now_ms:.1f} ms now against {profiled:.1f} ms when "
                    f"{path} was measured ({cached.get('measured_at', '?')}): this machine's speed has changed, so "
                    f"--tree auto sizes trees from stale costs; measure again with `taps profile --measure`")
    return {"one_token_ms": round(now_ms, 3), "profiled_ms": profiled, "changed": changed}


def profile(target: Target, head=None, drafter_digest: str | None = None, measure: bool = False,
            repeats: int = 5, prefix: int = 200, root: Path | None = None) -> dict:
    """The cached profile for this machine, target, dtype and threads (measured if missing or
    `measure`); with a head, its draft levels too."""
    dtype = str(target.dtype).removeprefix("torch.")
    threads = torch.get_num_threads()
    path = profile_path(target.name, dtype, threads, drafter_digest, root)
    if path.is_file() and not measure:
        cached = read_json(path, "a cached profile of this machine (taps profile --measure replaces it)")
        if cached.get("format_version") == FORMAT_VERSION and (head is None or "draft_level_ms" in cached):
            return {**cached, "path": str(path), "speed_check": check_speed(target, cached, path)}
    result = {"format_version": FORMAT_VERSION, "machine": machine(), "target": target.name, "dtype": dtype,
              "threads": threads, "device": str(target.device), "prefix_tokens": prefix, "repeats": repeats,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "target_forward_ms": {str(n): round(ms, 3) for n, ms in time_target(target, prefix=prefix,
                                                                                   repeats=repeats).items()}}
    by_context = time_contexts(target, repeats=repeats)
    result["verify_ms_by_context"] = {str(c): {str(n): round(ms, 3) for n, ms in t.items()} for c, t in by_context.items()}
    result["verify_split"] = split_by_path(target, list(by_context), repeats=repeats)
    if head is not None:
        result["drafter"] = drafter_digest
        result["draft_level_ms"] = {str(k): round(ms, 3) for k, ms in time_draft_level(head, target, prefix=prefix,
                                                                                        repeats=repeats).items()}
    write_json_atomic(path, result)
    result["path"] = str(path)
    return result


def profile_report(target: TargetRef, drafter: str | None = None, threads: int | None = None, repeats: int = 5,
                   measure: bool = False) -> str:
    """`taps profile`: this machine's profile (cached, or measured now) as Markdown tables."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if threads is not None:
        torch.set_num_threads(threads)
    loaded = target.load()
    head = load_head(drafter, loaded) if drafter else None
    # keyed as --tree auto looks it up (tree_policy): a draft level's cost depends on the head's
    # shape and draft vocabulary, not its weights
    result = profile(loaded, head, head_shape_key(head) if head is not None else None, measure=measure,
                     repeats=repeats)
    base = result["target_forward_ms"]["1"]
    lines = [f"{result['target']} ({result['dtype']}, {result['threads']} thread(s), {result['machine']['cpu']}); "
             f"profile: {result['path']}", "| tree tokens | target forward ms | x one token |",
             "| ---: | ---: | ---: |"]
    lines += [f"| {n} | {ms:.1f} | {ms / base:.2f} |" for n, ms in result["target_forward_ms"].items()]
    lines += context_tables(result)
    if "draft_level_ms" in result:
        lines += ["", "| beams | draft level ms |", "| ---: | ---: |"]
        lines += [f"| {k} | {ms:.2f} |" for k, ms in result["draft_level_ms"].items()]
    return "\n".join(lines)


def context_tables(result: dict) -> list[str]:
    """The verify cost by committed context (one token, SPLIT_NODES nodes, their ratio) and the
    split of a SPLIT_NODES-node forward, per attention path, as Markdown lines."""
    by_context = result.get("verify_ms_by_context") or {}
    if not by_context:
        return []
    n = str(SPLIT_NODES)
    lines = ["", f"| committed context | one-token forward ms | {n}-node tree ms | ratio |", "| ---: | ---: | ---: | ---: |"]
    for c, t in by_context.items():
        lines.append(f"| {c} | {t['1']:.1f} | {t[n]:.1f} | {t[n] / t['1']:.2f}x |")
    for path, splits in (result.get("verify_split") or {}).items():
        lines += ["", f"{n}-node tree forward, {path}: where the time goes (ms)", "",
                  "| committed context | total | " + " | ".join(SPLIT_PARTS) + " |",
                  "| ---: " * (len(SPLIT_PARTS) + 2) + "|"]
        for c, parts in splits.items():
            lines.append(f"| {c} | {parts['total']:.1f} | " + " | ".join(f"{parts[p]:.1f}" for p in SPLIT_PARTS) + " |")
    return lines


AUTO_NEEDS_A_HEAD = ("--tree auto sizes the trees of EAGLE heads and none is given: give a head with --drafter "
                     "(a study: a variant with one), or use fixed trees (eval.tree.mode: fixed)")


def tree_policy(target, heads: Iterable, speculation: SpeculationConfig):
    """The tree policy of a run, built here and nowhere else: None for fixed trees; for mode
    auto, a factory of AutoTree policies (one per drafter: each calibrates its own confidences)
    from the cached profile of this machine, target, dtype and threads, with the first head's
    draft levels (measured now, once, if missing). `heads`: every loaded member the run may
    draft with; auto sizes the trees of EAGLE heads, so a run without one is refused (plain
    decoding and prompt lookup have no tree to size)."""
    if not speculation.auto:
        return None
    head = next((h for h in heads if isinstance(h, DraftHead)), None)
    if head is None:
        raise ValueError(AUTO_NEEDS_A_HEAD)
    costs = StepCosts.from_profile(profile(target, head, drafter_digest=head_shape_key(head)))
    top_k = speculation.tree.top_k
    return lambda: AutoTree(costs, top_k=top_k)


def head_shape_key(head) -> str:
    """What a draft level's cost depends on: the head's shape and draft vocabulary, not its weights."""
    cfg = head.config
    draft_ids = getattr(head, "draft_ids", None)
    vocab = int(draft_ids.numel()) if draft_ids is not None else int(cfg.vocab_size)
    return f"shape:{cfg.hidden_size}x{cfg.intermediate_size}x{cfg.num_attention_heads}/{cfg.num_key_value_heads}:v{vocab}"
