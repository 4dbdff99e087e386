"""Measured costs on this machine: the target's tree forward per node count and a draft level
per beam count, for one target, dtype and thread count (`taps profile`).

Speculative decoding pays when accepted tokens outrun what a tree costs, and what a tree costs
depends on the machine: on a GPU verifying 60 tokens costs about one token's forward, on a CPU
several (SmolLM2-135M, bf16, one thread: 58 ms for 1 token, 103 ms for 64). Cost-aware trees
and the benchmarks read these numbers instead of assuming them.

A profile is a small JSON file cached under `$TAPS_CACHE_DIR/profiles`, keyed by the machine
(CPU or GPU model, cores, torch version), the target, the dtype and the thread count (and the
drafter's weights when one is profiled); `measure=True` replaces it. Every figure is the median
of `repeats` interleaved rounds after a warm-up, so a noisy neighbour shifts all sizes alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from taps import kv
from taps.config import SpeculationConfig
from taps.drafter.auto_tree import AutoTree, StepCosts
from taps.drafter.checkpoint import load_head
from taps.drafter.context import consume
from taps.drafter.head import DraftHead
from taps.jsonl import read_json, write_json_atomic
from taps.stopwatch import now
from taps.target import Target
from taps.target_source import cache_root
from taps.tree import DraftTree, additive_mask

TREE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
BEAM_SIZES = (1, 2, 4, 6, 8, 10, 16)
FORMAT_VERSION = 1


def machine() -> dict:
    """What makes timings comparable: processor, cores, torch build, accelerator."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "gpu": gpu}


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
            return {**cached, "path": str(path)}
    result = {"format_version": FORMAT_VERSION, "machine": machine(), "target": target.name, "dtype": dtype,
              "threads": threads, "device": str(target.device), "prefix_tokens": prefix, "repeats": repeats,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "target_forward_ms": {str(n): round(ms, 3) for n, ms in time_target(target, prefix=prefix,
                                                                                   repeats=repeats).items()}}
    if head is not None:
        result["drafter"] = drafter_digest
        result["draft_level_ms"] = {str(k): round(ms, 3) for k, ms in time_draft_level(head, target, prefix=prefix,
                                                                                        repeats=repeats).items()}
    write_json_atomic(path, result)
    result["path"] = str(path)
    return result


def profile_report(target_spec: str, drafter: str | None = None, threads: int | None = None, repeats: int = 5,
                   measure: bool = False, device: str = "auto", dtype: str = "auto") -> str:
    """`taps profile`: this machine's profile (cached, or measured now) as Markdown tables."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if threads is not None:
        torch.set_num_threads(threads)
    target = Target.load(target_spec, device=device, dtype=dtype)
    head = load_head(drafter, target) if drafter else None
    # keyed as --tree auto looks it up (tree_policy): a draft level's cost depends on the head's
    # shape and draft vocabulary, not its weights
    result = profile(target, head, head_shape_key(head) if head is not None else None, measure=measure,
                     repeats=repeats)
    base = result["target_forward_ms"]["1"]
    lines = [f"{result['target']} ({result['dtype']}, {result['threads']} thread(s), {result['machine']['cpu']}); "
             f"profile: {result['path']}", "| tree tokens | target forward ms | x one token |",
             "| ---: | ---: | ---: |"]
    lines += [f"| {n} | {ms:.1f} | {ms / base:.2f} |" for n, ms in result["target_forward_ms"].items()]
    if "draft_level_ms" in result:
        lines += ["", "| beams | draft level ms |", "| ---: | ---: |"]
        lines += [f"| {k} | {ms:.2f} |" for k, ms in result["draft_level_ms"].items()]
    return "\n".join(lines)


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
        raise ValueError("--tree auto sizes the trees of EAGLE heads and none is given: give a head with --drafter "
                         "(a study: a variant with one), or use fixed trees (eval.tree.mode: fixed)")
    costs = StepCosts.from_profile(profile(target, head, drafter_digest=head_shape_key(head)))
    top_k = speculation.tree.top_k
    return lambda: AutoTree(costs, top_k=top_k)


def head_shape_key(head) -> str:
    """What a draft level's cost depends on: the head's shape and draft vocabulary, not its weights."""
    cfg = head.config
    draft_ids = getattr(head, "draft_ids", None)
    vocab = int(draft_ids.numel()) if draft_ids is not None else int(cfg.vocab_size)
    return f"shape:{cfg.hidden_size}x{cfg.intermediate_size}x{cfg.num_attention_heads}/{cfg.num_key_value_heads}:v{vocab}"
