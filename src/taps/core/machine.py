"""This machine: what makes timings comparable (`machine()`), and the CPU dtype `--dtype auto`
runs a target in, chosen by timing a verify step in both, not by CPU model.

Why measure: bf16 was picked only on CPUs with AMX tiles, but an AMD EPYC with AVX512-BF16 and no
AMX ran SmolLM2-135M in bf16 at 35 tokens/s (2 threads) while float32, which the rule chose there,
made `make demo` take three times as long. What is fast depends on the CPU's instructions, the
torch build and the thread count, so the choice is a measurement: a 16-node tree forward after
512 committed tokens (the Target's verify step, through taps.core.attention) in float32 and in bf16,
the faster wins (float32 on a tie: it is the exact one). It is cached per machine, target and
thread count beside the profiles, and a new measurement says what it chose and why.
`TAPS_CPU_DTYPE=float32|bfloat16` pins the choice instead (the tests pin float32, so that no
test's outcome hangs on a timing).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from taps.core import attention, packed
from taps.core.jsonl import read_json, write_json_atomic
from taps.core.stopwatch import now
from taps.core.targets import cache_root

log = logging.getLogger(__name__)

STEP_CONTEXT = 512  # committed tokens before the timed step
STEP_NODES = 16  # the timed tree: a chain of this many nodes
FORMAT_VERSION = 2  # 2: linear weights packed (taps.core.packed), as the Target runs them
PIN_VARIABLE = "TAPS_CPU_DTYPE"


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


@torch.inference_mode()
def tree_step_ms(model, context: int = STEP_CONTEXT, nodes: int = STEP_NODES, repeats: int = 3) -> float:
    """Median ms of one verify step of the model as it is (its dtype): a `nodes`-node chain after
    `context` committed random tokens, through the tree attention the Target uses."""
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    device = model.get_input_embeddings().weight.device
    attention.enable(model)
    packed.pack_linears(model)  # as the Target runs it (a cast model repacks at its first forward)
    cache = DynamicCache()
    context = min(context, int(model.config.get_text_config().max_position_embeddings) - nodes)
    model(input_ids=torch.randint(0, vocab, (1, context), generator=gen).to(device), cache=cache, use_cache=True,
          logits_to_keep=1)
    ids = torch.randint(0, vocab, (1, nodes), generator=gen).to(device)  # [1, N]
    chain = torch.ones(nodes, nodes, dtype=torch.bool, device=device).tril()  # [N, N] ancestors of a chain
    depth = torch.arange(nodes, device=device)  # [N]
    block = attention.TreeBlock(chain, depth, context)
    times = []
    for round_ in range(repeats + 1):  # round 0 warms up
        t0 = now(device)
        model(input_ids=ids, position_ids=(context + depth)[None], attention_mask=chain[None, None], cache=cache,
              use_cache=True, **{attention.TREE_KWARG: block})
        t1 = now(device)
        cache.crop(-nodes)  # drop the step's rows
        if round_:
            times.append((t1 - t0) * 1e3)
    return statistics.median(times)


def _choice_path(target: str, threads: int, root: Path | None) -> Path:
    key = json.dumps({"machine": machine(), "target": target, "threads": threads}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(target).name or "target")
    return (root or cache_root() / "profiles") / f"dtype-{safe}-t{threads}-{digest}.json"


def choose(fp32_ms: float, bf16_ms: float) -> torch.dtype:
    """bf16 only where it is faster: float32 is the dtype in which greedy decoding is exact."""
    return torch.bfloat16 if bf16_ms < fp32_ms else torch.float32


def cpu_dtype(path: Path, target: str, trust_remote_code: bool = False, root: Path | None = None,
              measure: bool = False) -> torch.dtype:
    """The dtype `--dtype auto` runs this target in on this CPU: cached, or measured now (the
    model loaded once in float32, timed, cast to bf16, timed again)."""
    pinned = os.environ.get(PIN_VARIABLE)
    if pinned is not None:
        if pinned not in ("float32", "bfloat16"):
            raise ValueError(f"{PIN_VARIABLE}={pinned!r}: expected float32 or bfloat16")
        return getattr(torch, pinned)
    threads = torch.get_num_threads()
    file = _choice_path(target, threads, root)
    cached = None if measure else _cached(file)
    if cached is not None:
        return cached
    file.parent.mkdir(parents=True, exist_ok=True)
    # several --jobs workers may load the target at once: one measures, the others wait and read
    # its choice (measuring side by side, they would slow each other and might choose apart)
    with open(file.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = None if measure else _cached(file)
        return cached if cached is not None else _measure(path, target, threads, trust_remote_code, file)


def _cached(file: Path) -> torch.dtype | None:
    if not file.is_file():
        return None
    cached = read_json(file, "the cached --dtype auto choice of this machine (delete it to measure again)")
    if cached.get("format_version") != FORMAT_VERSION or cached.get("dtype") not in ("float32", "bfloat16"):
        return None
    log.info(f"--dtype auto: {cached['dtype']} ({cached['why']}; {file})")
    return getattr(torch, cached["dtype"])


def _measure(path: Path, target: str, threads: int, trust_remote_code: bool, file: Path) -> torch.dtype:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True,
                                                 trust_remote_code=trust_remote_code).eval()
    fp32_ms = tree_step_ms(model)
    bf16_ms = tree_step_ms(model.to(torch.bfloat16))
    dtype = choose(fp32_ms, bf16_ms)
    name = str(dtype).removeprefix("torch.")
    why = (f"a {STEP_NODES}-node verify step after {STEP_CONTEXT} tokens took {bf16_ms:.1f} ms in bf16 and "
           f"{fp32_ms:.1f} ms in float32 at {threads} thread(s) on {machine()['cpu']}")
    write_json_atomic(file, {"format_version": FORMAT_VERSION, "machine": machine(), "target": target,
                             "threads": threads, "dtype": name, "bf16_ms": round(bf16_ms, 3),
                             "float32_ms": round(fp32_ms, 3), "why": why})
    log.warning(f"--dtype auto: chose {name}: {why} (cached in {file}; greedy output is token-identical to plain "
                f"decoding only in float32: pass --dtype float32 for that)")
    return dtype
