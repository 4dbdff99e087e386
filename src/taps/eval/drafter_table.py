"""The model card's acceptance table: every shipped drafter on the first n GSM8K-test and n
MT-Bench (first turn) questions, at temperatures 0 and 1, with the pooled acceptance length
(new tokens / verifier calls, docs/spec.md §5) of each cell: the quick, per-head view of a family of
heads that a model card quotes (the study, `taps eval`, measures compositions and more).

The table is written after every drafter and a rerun measures only the drafters whose weights
or settings changed, so a table can grow while heads are still training."""

from __future__ import annotations

import json
import os
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from taps.core import workers
from taps.core.config import DecodeConfig, SamplingConfig, TreeConfig
from taps.data.sources import DATA_DIR_ENV
from taps.core.decode import chat_ids, generate
from taps.drafter.checkpoint import load_head, weights_digest
from taps.eval.benchmarks import load_benchmark
from taps.core.jsonl import read_json, write_json_atomic
from taps.core.outputs import check_output_file
from taps.propose.single import SingleProposer
from taps.core.target import Target, TargetRef

BENCHES = ("gsm8k", "mt_bench")


@dataclass(frozen=True)
class TableSettings:
    """What a table's cells are measured on and with, in one object because it travels whole from
    `taps drafter table` to acceptance_table and to every worker process. OUT.json keeps all of it
    but `data_dir` (table_settings): rows measured under other settings are measured again."""

    data_dir: str | Path | None  # the benchmarks' data directory (None: $TAPS_DATA_DIR, else the hub)
    n: int = 20  # first questions of each benchmark
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_new_tokens: int = 256
    seed: int = 0  # question i of a cell decodes with seed + i


def bench_prompts(data_dir: str | Path | None, n: int) -> dict[str, list[str]]:
    """The first user turn of the first n questions of each benchmark."""
    return {bench: [q.turns[0] for q in load_benchmark(bench, data_dir, limit=n)] for bench in BENCHES}


def acceptance_table(target: Target, drafters: dict[str, Path], settings: TableSettings,
                     tree: TreeConfig = TreeConfig(), done: dict | None = None,
                     on_drafter: Callable[[str, dict], None] | None = None, progress: bool = False) -> dict:
    """{drafter: {bench: {temperature: {"tau", "new_tokens", "verifier_calls"}}}}; drafters in
    `done` are taken from it unmeasured, `on_drafter(name, table)` runs after each measured one."""
    prompts = {b: [chat_ids(target.tokenizer, [{"role": "user", "content": q}]) for q in qs]
               for b, qs in bench_prompts(settings.data_dir, settings.n).items()}
    stops = target.stop_token_ids()
    temperatures = settings.temperatures
    table: dict = {}
    todo = [name for name in drafters if not (done and name in done)]
    bar = tqdm(total=len(todo) * sum(map(len, prompts.values())) * len(temperatures), desc="drafter table",
               unit="answer", dynamic_ncols=True, disable=not progress)
    for name, path in drafters.items():
        if done and name in done:
            table[name] = done[name]
            continue
        bar.set_postfix_str(name)
        proposer = SingleProposer(load_head(path, target), tree)
        for bench, ids_list in prompts.items():
            for temp in temperatures:
                new = calls = 0
                for i, ids in enumerate(ids_list):
                    cfg = DecodeConfig(max_new_tokens=settings.max_new_tokens, sampling=SamplingConfig(temp),
                                       stop_token_ids=stops, seed=settings.seed + i)
                    result = generate(target, proposer, ids, cfg)
                    new, calls = new + len(result.tokens), calls + result.verifier_calls
                    bar.update(1)
                table.setdefault(name, {}).setdefault(bench, {})[str(temp)] = {
                    "tau": new / calls, "new_tokens": new, "verifier_calls": calls}
        if on_drafter is not None:
            on_drafter(name, table)
    bar.close()
    return table


def table_settings(target: Target, settings: TableSettings) -> dict:
    """The settings OUT.json records (the target by its tokenizer and dtype)."""
    return {"target_tokenizer": target.fingerprint(), "n": settings.n, "temperatures": list(settings.temperatures),
            "max_new_tokens": settings.max_new_tokens, "seed": settings.seed,
            "dtype": str(target.dtype).removeprefix("torch.")}


def reusable_rows(previous_json: str | Path, settings: dict, digests: dict[str, str]) -> dict:
    """Rows of an earlier OUT.json measured with the same settings and the same weights."""
    path = Path(previous_json)
    if not path.is_file():
        return {}
    old = read_json(path, "an earlier drafter table (delete it to measure every drafter again)", ValueError, kind=None)
    if not isinstance(old, dict) or old.get("settings") != settings:
        return {}
    return {name: row for name, row in old.get("drafters", {}).items()
            if name in digests and old.get("weights", {}).get(name) == digests[name]}


def table_of_directory(target: TargetRef, drafters_dir: str | Path, out: str | Path, data_dir: str | None = None,
                       n: int = 20, temperatures: tuple[float, ...] = (0.0, 1.0), max_new_tokens: int = 256,
                       jobs: int = 1) -> str:
    """`taps drafter table`: every drafter of a directory (<name>/model.safetensors), measured or
    reused (update_table), as a Markdown table, with `target` (the CLI's: on the CPU, float32 unless
    --dtype; `jobs` > 1 workers load it on the CPU in its dtype). data_dir None: $TAPS_DATA_DIR,
    else the hub."""
    root = Path(drafters_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"--drafters {root}: no such directory")
    drafters = {p.name: p for p in sorted(root.iterdir()) if (p / "model.safetensors").is_file()}
    if not drafters:
        raise FileNotFoundError(f"{root}: no drafter directories (<name>/model.safetensors)")
    for suffix, holds in ((".json", _is_table), (".md", lambda path: _is_table(path.with_suffix(".json")))):
        check_output_file(Path(out).with_suffix(suffix), "--out", holds=holds, what="a drafter table")
    settings = TableSettings(data_dir or os.environ.get(DATA_DIR_ENV), n, temperatures, max_new_tokens)
    table = update_table(target.load(), drafters, out, settings, jobs=jobs)
    return to_markdown(table, temperatures)


def _is_table(path: Path) -> bool:
    """Whether OUT.json is a drafter table (OUT.md is written beside it): anything else at those
    names (a features manifest.json, say) is never overwritten."""
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(table, dict) and {"settings", "drafters"} <= table.keys()


def update_table(target: Target, drafters: dict[str, Path], out: str | Path, settings: TableSettings,
                 log: Callable[[str], None] = print, progress: bool = True, jobs: int = 1) -> dict:
    """Measure the drafters not yet in OUT.json (same settings and weights), writing OUT.json and
    OUT.md after each one; returns the full table. jobs > 1 measures that many drafters at once in
    separate processes (each loads the target from the directory `target` was loaded from); every
    cell is seeded per question, so the rows are those of a sequential run."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    out = Path(out)
    recorded = table_settings(target, settings)
    digests = {name: weights_digest(path) for name, path in drafters.items()}
    done = reusable_rows(out.with_suffix(".json"), recorded, digests)
    if done:
        log(f"{out.with_suffix('.json')}: reusing {', '.join(sorted(done))}")
    clock = {"t": time.time()}

    def save(name: str, table: dict, seconds: float | None = None) -> None:
        write_table(table, out, settings.temperatures, recorded, {k: digests[k] for k in table})
        log(f"{name}: measured in {time.time() - clock['t'] if seconds is None else seconds:.0f} s")
        clock["t"] = time.time()

    todo = [name for name in drafters if name not in done]
    if jobs > 1 and len(todo) > 1:
        if target.source_dir is None:
            raise ValueError("update_table(jobs > 1) needs a target loaded from a directory (Target.load): each "
                             "worker process loads its own")
        table = dict(done)
        copy = TargetRef(str(target.source_dir), "cpu", recorded["dtype"])  # what each worker loads
        _measure_in_workers(table, {k: drafters[k] for k in todo}, copy, settings, jobs, save)
    else:
        table = acceptance_table(target, drafters, settings, done=done, on_drafter=save, progress=progress)
    write_table(table, out, settings.temperatures, recorded, {k: digests[k] for k in table})
    return table


def _table_worker(target: TargetRef, drafters: dict[str, Path], settings: TableSettings,
                  order: list[str], taken, results, threads: int) -> None:
    """One process of `--jobs N`: measures the next unmeasured drafter of `order` until none is left."""
    torch.set_num_threads(threads)
    loaded = target.load()
    for name in workers.untaken(order, taken):
        t0 = time.time()
        try:
            row = acceptance_table(loaded, {name: drafters[name]}, settings)[name]
            results.put((name, row, time.time() - t0, None))
        except Exception as e:  # reported by the parent, naming the drafter
            results.put((name, None, 0.0, f"{type(e).__name__}: {e}"))


def _measure_in_workers(table: dict, todo: dict[str, Path], target: TargetRef, settings: TableSettings,
                        jobs: int, save: Callable) -> None:
    """Fill `table` with the rows of `todo`, measured by `jobs` processes; `save` runs after each."""
    taken, results = workers.counter(), workers.SPAWN.Queue()
    jobs = min(jobs, len(todo))
    threads = workers.cores_each(jobs)
    procs = workers.start(_table_worker, [(target, todo, settings, list(todo), taken, results, threads)]
                          * jobs)
    pending, errors = set(todo), []
    while pending:
        try:
            name, row, seconds, err = results.get(timeout=2.0)
        except queue.Empty:
            if any(proc.is_alive() for proc in procs) or not results.empty():
                continue
            break  # every worker is gone and nothing is left to read
        pending.discard(name)
        if err:
            errors.append(f"{name} ({err})")
            continue
        table[name] = row
        save(name, table, seconds)
    workers.join(procs)
    if errors or pending:
        failed = errors + sorted(f"{name} (its worker died)" for name in pending)
        raise RuntimeError(f"drafter table: not measured: {', '.join(failed)}; the rows measured are saved, and a "
                           "rerun measures only the rest")


def to_markdown(table: dict, temperatures: tuple[float, ...] = (0.0, 1.0)) -> str:
    cols = [(b, str(t)) for t in temperatures for b in BENCHES]
    head = "| drafter | " + " | ".join(f"{b} T={t}" for b, t in cols) + " |"
    rows = [head, "| --- |" + " --- |" * len(cols)]
    for name in sorted(table):
        rows.append(f"| {name} | " + " | ".join(f"{table[name][b][t]['tau']:.2f}" for b, t in cols) + " |")
    return "\n".join(rows) + "\n"


def write_table(table: dict, out: str | Path, temperatures=(0.0, 1.0), settings: dict | None = None,
                weights: dict | None = None) -> None:
    """OUT.json ({"settings", "weights", "drafters"}) and OUT.md, each replaced atomically."""
    out = Path(out)
    write_json_atomic(out.with_suffix(".json"), {"settings": settings or {}, "weights": weights or {}, "drafters": table})
    tmp = out.with_name(out.name + ".md.tmp")
    tmp.write_text(to_markdown(table, temperatures))
    tmp.replace(out.with_suffix(".md"))
