"""`taps eval`: decode every benchmark question with every variant, one record per turn.

Order: for each question, for each temperature, every variant in turn — so all variants see the
same machine noise and the baseline's speed is measured side by side with theirs (docs/spec.md §5).
MT-Bench's second turn continues each variant's own conversation (its own first answer).

Resumable: the turns of one conversation are appended in one write (taps.core.jsonl); a rerun skips
every conversation already written, in records.jsonl or in a shard, and never rewrites them.
`run.json` pins what the records mean (target, tree, max_new_tokens, variant specs): a rerun with
a different one is refused rather than mixed in.

Sharded: under `accelerate launch` / `torchrun` (WORLD_SIZE > 1) or `--jobs`, process r takes
questions r, r + W, ... (or, where there are more variants than questions, as in `taps demo`'s one
question per benchmark, variants r, r + W, ...: four questions of which one has two turns split
3:2 and left one process idle for a third of the run) and writes shards/rank-r.jsonl; at the end
rank 0 merges the shards into records.jsonl and removes them.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from taps.core import workers
from taps.core.config import DecodeConfig, SamplingConfig, SpeculationConfig
from taps.core.decode import ChatSession, chat_ids
from taps.drafter.checkpoint import weights_digest
from taps.eval.benchmarks import Question
from taps.eval.records import TurnIdentity, conversation_key, read_records, record_key, turn_record
from taps.core.identity import MismatchError, check_same
from taps.core.jsonl import append_jsonl, read_json, read_jsonl, write_json_atomic
from taps.core.outlock import output_lock
from taps.core.outputs import check_output_dir
from taps.core.replay import ReferenceCache, ReplaySession
from taps.drafter.profile import AUTO_NEEDS_A_HEAD, tree_policy
from taps.propose.factory import HeadPool
from taps.propose.rest import is_datastore
from taps.propose.spec import VariantSpec, is_lookup
from taps.core.target import Target, TargetRef

RECORDS = "records.jsonl"
SHARDS = "shards"
RUN_INFO = "run.json"
TARGET_KEYS = ("target_weights", "target_dtype")  # Target.identity(): the target by content


class ResultsMismatchError(ValueError):
    """Records in a results directory were made under something else than this run. `key` names
    what: a run.json setting, "variant", or "drafter_weights"."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


MISMATCH = ".mismatch.json"  # a --jobs worker's note of the ResultsMismatchError it stopped at, for the parent
ACCEPTANCE = ("verify", "replay")  # how a run measures acceptance: every tree verified, or replayed (T = 0)


@dataclass(frozen=True)
class EvalSettings:
    temperatures: tuple[float, ...] = (0.0,)
    max_new_tokens: int = 512
    seed: int = 0
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)  # the tree mode and shape
    top_p: float = 1.0
    warmup: bool = True  # decode a few tokens with every variant before timing anything
    acceptance: str = "verify"  # "replay": greedy acceptance read along the target's own answer (core/replay.py)

    def __post_init__(self) -> None:
        """What a run would refuse at its first question, refused when the settings are made: a
        study's --dry-run builds them too, so it checks exactly what the run checks."""
        for t in self.temperatures:
            SamplingConfig(temperature=t, top_p=self.top_p)
        if not self.temperatures:
            raise ValueError("temperatures must name at least one temperature")
        if self.acceptance not in ACCEPTANCE:
            raise ValueError(f"acceptance must be one of {', '.join(ACCEPTANCE)}, got {self.acceptance!r}")
        if self.acceptance == "replay" and any(t != 0 for t in self.temperatures):
            raise ValueError("acceptance replay measures greedy acceptance: temperatures must be 0 only, got "
                             f"{', '.join(f'{t:g}' for t in self.temperatures)}")
        for name in ("max_new_tokens", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (name == "max_new_tokens"):
                raise ValueError(f"{name} must be an integer >= {int(name == 'max_new_tokens')}, got {value!r}")


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    world: int = 1

    def mine(self, index: int) -> bool:
        return index % self.world == self.rank


def shard_units(questions: Sequence[Question], temperatures: Sequence[float], variants: Sequence[VariantSpec],
                shard: Shard) -> list[tuple]:
    """This process's (question, temperature, variant) units, in the single process's order. Split
    along the longer axis: by question (every variant of a question in one process, side by side),
    or, with more variants than questions, by variant (each variant sees every question in the
    single process's order, so what it learns across questions is the same). The split depends only
    on the inputs, never on what is already done, so every rank of a resumed run agrees on it."""
    by_variant = len(variants) > len(questions)
    return [(q, t, v) for i, q in enumerate(questions) if by_variant or shard.mine(i)
            for t in temperatures for j, v in enumerate(variants) if not by_variant or shard.mine(j)]


def current_shard() -> Shard:
    """This process's shard under accelerate / torchrun (both set RANK and WORLD_SIZE)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return Shard(int(os.environ.get("RANK", "0")), world) if world > 1 else Shard()


def question_seed(base: int, bench: str, question_id: str, temperature: float) -> int:
    """A seed per (question, temperature) shared by all variants: stable across runs and shards."""
    digest = hashlib.sha256(f"{base}|{bench}|{question_id}|{temperature}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def run_info(target, target_dir: str, variants: Sequence[VariantSpec], settings: EvalSettings,
             questions: Sequence[Question] = ()) -> dict:
    benches: dict[str, int] = {}
    for q in questions:
        benches[q.bench] = benches.get(q.bench, 0) + 1
    return {"target": str(target_dir), "target_fingerprint": target.fingerprint(), **target.identity(),
            "tree": asdict(settings.speculation.tree), "max_new_tokens": settings.max_new_tokens, "seed": settings.seed,
            "top_p": settings.top_p, "variants": {v.name: v.describe() for v in variants},
            "drafter_weights": drafter_weights(variants),
            "temperatures": list(settings.temperatures), "benches": benches,
            **({"tree_mode": "auto"} if settings.speculation.auto else {}),  # absent: fixed (older results)
            **({"acceptance": "replay"} if settings.acceptance == "replay" else {})}  # absent: verified


def drafter_weights(variants: Sequence[VariantSpec]) -> dict[str, str]:
    """sha256 of every member drafter's weights, by path: a head retrained in place is a new head."""
    paths = sorted({path for v in variants for _, path in v.drafters})
    return {p: weights_digest(p) for p in paths if (Path(p) / "model.safetensors").is_file()}


def check_run_info(out: Path, info: dict) -> dict:
    """Refuse to mix records made under other settings; merge in new variants."""
    path = out / RUN_INFO
    if not path.is_file():
        return info
    old = read_json(path, "the run.json of these results (fix or remove it)",
                    lambda message: ResultsMismatchError(message, RUN_INFO))
    for key in ("target_fingerprint", "tree", "tree_mode", "acceptance", "max_new_tokens", "seed", "top_p"):
        if old.get(key) != info.get(key):  # tree_mode and acceptance are written only when not the default
            raise ResultsMismatchError(
                f"{path}: these results were made with {key} = {old.get(key)!r}, this run has {info.get(key)!r}; "
                "use another --out (or the same settings) so records of different runs are never mixed", key)
    try:  # results written before the target's identity was recorded: accepted once, recorded from now on
        missing = check_same(path, old, info, TARGET_KEYS, "use another --out so records of two targets (of one "
                                                           "tokenizer, say a base model and its instruct version) "
                                                           "are never mixed")
    except MismatchError as err:
        raise ResultsMismatchError(str(err), err.key) from None
    old.update({k: info[k] for k in missing})
    for name, spec in info["variants"].items():
        if name in old.get("variants", {}) and old["variants"][name] != spec:
            raise ResultsMismatchError(f"{path}: variant {name!r} was {old['variants'][name]}, now {spec}; "
                                       "give the new one another name or use another --out", "variant")
    old_weights = old.get("drafter_weights", {})  # absent in results written before it was recorded
    changed = sorted(p for p, digest in info["drafter_weights"].items() if p in old_weights and old_weights[p] != digest)
    if changed:
        raise ResultsMismatchError(f"{path}: the weights of {', '.join(changed)} changed since these results were "
                                   "made (retrained?); use another --out so old and new heads are never mixed",
                                   "drafter_weights")
    temperatures = sorted(set(old.get("temperatures", [])) | set(info["temperatures"]))
    benches = {b: max(n, info["benches"].get(b, 0)) for b, n in old.get("benches", {}).items()}
    return {**old, "variants": {**old.get("variants", {}), **info["variants"]},
            "drafter_weights": {**old_weights, **info["drafter_weights"]}, "temperatures": temperatures,
            "benches": {**info["benches"], **benches}}


def written_records(out: Path):
    """Every record already written in the results directory: the merged file, then the shards."""
    for path in [out / RECORDS, *sorted((out / SHARDS).glob("*.jsonl"))]:
        yield from read_records(path)


def finished(out: Path) -> set[tuple]:
    """Conversation keys already written anywhere in the results directory."""
    return {conversation_key(r) for r in written_records(out)}


def _resume_learning(pool: HeadPool, variants: Sequence[VariantSpec], settings: EvalSettings, out: Path) -> None:
    """A route-bandit variant learns across the questions of a run (its state is kept in `pool`);
    resumed, it first learns again from its records already written, in the order they were
    written, so it goes on as the interrupted run would have (exactly, for one process; a --jobs
    worker learns from its own questions, and on resume from every worker's records so far)."""
    learning = {v.name: pool.bandit(v, settings.speculation.tree) for v in variants}
    learning = {name: state for name, state in learning.items() if state is not None}
    if not learning:
        return
    for record in written_records(out):
        if record["variant"] in learning:
            learning[record["variant"]].replay([record])


def decode_conversation(target, proposer, question: Question, cfg: DecodeConfig,
                        references: ReferenceCache | None = None) -> list:
    """Every turn of one question in one chat session: (DecodeResult, reply text) per turn; with
    `references`, each turn replayed against the target's own greedy reply (core/replay.py)."""
    session = ChatSession(target, proposer, cfg) if references is None else ReplaySession(target, proposer, cfg,
                                                                                          references)
    turns = []
    for text in question.turns:
        prompt_len = len(chat_ids(target.tokenizer, session.messages + [{"role": "user", "content": text}]))
        room = target.context_window - prompt_len
        if room < 1:
            raise ValueError(f"{question.bench} question {question.question_id}: the turn's prompt has {prompt_len} "
                             f"tokens, the target's context window is {target.context_window}")
        session.cfg = replace(session.cfg, max_new_tokens=min(cfg.max_new_tokens, room))
        reply, result = session.send(text)
        turns.append((result, reply))
    return turns


def run_eval(target, target_dir: str, variants: Sequence[VariantSpec], questions: Sequence[Question],
             out: str | Path, settings: EvalSettings = EvalSettings(), shard: Shard | None = None,
             progress: bool = True, merge: bool = True) -> int:
    """Decode what is not yet in `out`; returns the number of conversations written by this process.
    merge=False: a worker of run_eval_jobs, whose parent merges the shards once every worker is done."""
    out = Path(out)
    shard = shard or current_shard()
    if not variants:
        raise ValueError("no --variant given")
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be unique, got {', '.join(names)}")
    if not questions:
        raise ValueError("no questions to decode (check --bench, --limit and --category)")
    # one writer per results directory (--jobs workers write under their parent's lock)
    with output_lock(out, "results") if shard.rank == 0 and merge else nullcontext():
        return _run_eval(target, target_dir, variants, questions, out, settings, shard, progress, merge)


def _run_eval(target, target_dir, variants, questions, out: Path, settings: EvalSettings, shard: Shard,
              progress: bool, merge: bool) -> int:
    info = check_run_info(out, run_info(target, target_dir, variants, settings, questions))
    pool = HeadPool(target)
    members = dict.fromkeys(path for v in variants for _, path in v.drafters)
    # loaded only as far as the policy needs (fixed trees: none of them); heads of one target share a shape
    policy = tree_policy(target, (pool.head(path) for path in members), settings.speculation)
    tree = settings.speculation.tree
    if shard.rank == 0:
        write_json_atomic(out / RUN_INFO, info)
    sink = out / RECORDS if shard.world == 1 else out / SHARDS / f"rank-{shard.rank}.jsonl"
    read_jsonl(sink, repair_torn=True)  # only this process appends to its sink
    done = finished(out)
    stop = target.stop_token_ids()
    units = [(q, t, v) for q, t, v in shard_units(questions, settings.temperatures, variants, shard)
             if (v.name, q.bench, float(t), q.question_id) not in done]
    if settings.warmup and units:
        warm = DecodeConfig(max_new_tokens=8, stop_token_ids=stop)
        for v in variants:
            decode_conversation(target, pool.proposer(v, tree, policy), Question("warmup", "0", "", ("Hello",)),
                                warm)
    pool.forget()  # the warmup teaches no route-bandit
    _resume_learning(pool, variants, settings, out)
    bar = _progress(len(units), progress and shard.rank == 0, shard)
    references = ReferenceCache() if settings.acceptance == "replay" else None  # shared by a question's variants
    for q, temperature, v in units:
        seed = question_seed(settings.seed, q.bench, q.question_id, temperature)
        cfg = DecodeConfig(max_new_tokens=settings.max_new_tokens, stop_token_ids=stop, seed=seed,
                           sampling=SamplingConfig(temperature=temperature, top_p=settings.top_p),
                           trace=bool(v.drafters))
        turns = decode_conversation(target, pool.proposer(v, tree, policy), q, cfg,
                                    references if v.drafters else None)  # the baseline decodes for real
        who = TurnIdentity(v.name, q.bench, q.question_id, 0, temperature, q.category, seed, v.member_names)
        append_jsonl(sink, [turn_record(result, replace(who, turn=i), reply)
                            for i, (result, reply) in enumerate(turns)])
        bar.update(1)
    bar.close()
    if shard.world > 1 and merge:
        _barrier()
        if shard.rank == 0:
            merge_shards(out)
        _barrier()
    return len(units)


def eval_benchmarks(target: TargetRef, variants: Sequence[VariantSpec], questions: Sequence[Question],
                    out: str | Path, settings: EvalSettings = EvalSettings(), jobs: int = 1,
                    progress: bool = True) -> str:
    """`taps eval` and a study's eval stage: the questions (of the benchmarks: benchmarks.load_questions)
    decoded by every variant into `out` (run_eval, or run_eval_jobs with `jobs` worker processes);
    returns a summary. `out` holds these results or none yet, never another kind (taps.core.outputs)."""
    check_output_dir(out, "eval results")
    if jobs > 1:
        total = run_eval_jobs(target, variants, questions, out, settings, jobs=jobs, progress=progress)
        return f"taps eval: {total} conversations in {out} ({jobs} worker processes)"
    written = run_eval(load_target_for_eval(target), target.path, variants, questions, out, settings,
                       progress=progress)
    return f"taps eval: {written} conversations decoded in this run; results in {out}"


def load_target_for_eval(target: TargetRef) -> Target:
    """The target on this process's device (under accelerate / torchrun each rank takes its own GPU)."""
    if target.device == "auto" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState

        target = replace(target, device=str(PartialState().device))
    return target.load()


def _eval_worker(target: TargetRef, variants, questions, out: str, settings: EvalSettings, shard: Shard,
                 progress: bool) -> None:
    """One process of run_eval_jobs: shard.rank's questions, on its share of the cores."""
    torch.set_num_threads(workers.cores_each(shard.world))
    try:
        run_eval(target.load(), target.path, variants, questions, out, settings, shard=shard, progress=progress,
                 merge=False)
    except ResultsMismatchError as err:  # the parent raises it again, as itself: `taps demo` moves such results aside
        write_json_atomic(Path(out) / SHARDS / f"rank-{shard.rank}{MISMATCH}", {"message": str(err), "key": err.key})
        raise


def run_eval_jobs(target: TargetRef, variants: Sequence[VariantSpec], questions: Sequence[Question],
                  out: str | Path, settings: EvalSettings = EvalSettings(), jobs: int = 2,
                  progress: bool = True) -> int:
    """run_eval in `jobs` processes on one machine (each every jobs-th question, with its share of
    the cores), then one merge: on a CPU, single-threaded processes decode more tokens per second
    in all than one process with every thread. Each record is the same as a one-process run's
    (every question's seed is its own); returns the conversations now in the results."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if not questions:
        raise ValueError("no questions to decode (check --bench, --limit and --category)")
    if settings.speculation.auto and not any(not is_lookup(path) and not is_datastore(path)
                                             for v in variants for _, path in v.drafters):
        raise ValueError(AUTO_NEEDS_A_HEAD)  # said here, once, not by every worker
    with output_lock(out, "results"):
        return _run_eval_jobs(target, variants, questions, Path(out), settings, jobs, progress)


def _run_eval_jobs(target: TargetRef, variants, questions, out: Path, settings, jobs, progress) -> int:
    failed = workers.join(workers.start(_eval_worker, [
        (target, list(variants), list(questions), str(out), settings, Shard(rank, jobs), progress and rank == 0)
        for rank in range(jobs)]))
    mismatch = _worker_mismatch(out)
    merge_shards(out)  # what the finished workers wrote is kept either way; a rerun decodes the rest
    if mismatch is not None:
        raise mismatch
    if failed:
        raise RuntimeError(f"eval worker(s) {', '.join(map(str, failed))} of {jobs} failed (see the traceback above); "
                           "their finished conversations are kept and a rerun decodes the rest")
    return len(read_records(out / RECORDS))


def _worker_mismatch(out: Path) -> ResultsMismatchError | None:
    """The results mismatch a worker refused to run under (each reads the same run.json, so the
    first says it for all), its notes removed."""
    notes = sorted((out / SHARDS).glob(f"*{MISMATCH}")) if (out / SHARDS).is_dir() else []
    found = [read_json(path, "a worker's mismatch note") for path in notes]
    for path in notes:
        path.unlink()
    return ResultsMismatchError(found[0]["message"], found[0]["key"]) if found else None


def merge_shards(out: Path) -> int:
    """Append every shard record not yet in records.jsonl (in key order), then remove the shards."""
    main = out / RECORDS
    read_jsonl(main, repair_torn=True)
    have = {record_key(r) for r in read_records(main)}
    shards = sorted((out / SHARDS).glob("*.jsonl"))
    new = sorted((r for path in shards for r in read_records(path) if record_key(r) not in have), key=record_key)
    append_jsonl(main, new)
    for path in shards:
        path.unlink()
    return len(new)


def _barrier() -> None:
    from accelerate import PartialState

    PartialState().wait_for_everyone()


class _Quiet:
    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


def _progress(total: int, show: bool, shard: Shard):
    if not show:
        return _Quiet()

    desc = "eval" if shard.world == 1 else f"eval (rank 0 of {shard.world})"
    return tqdm(total=total, desc=desc, unit="conv", file=sys.stderr, dynamic_ncols=True, mininterval=1.0)
