"""A family of specialist drafters for one target, with the project's own pipeline:
`taps data mix` -> [`taps data regenerate`] -> `taps features` -> `taps train`, for both backbones
and four training sets, in the paper's proportions at any scale (N records per domain):

    chat         N English ShareGPT conversations
    math         N GSM8K-train problems (our offline stand-in for MathInstruct)
    mixed-small  N/2 chat + N/2 math   (the paper's 35k + 35k)
    mixed-large  N chat + N math       (the paper's 70k + 70k)
    mixed-xl     a larger draw of both, made apart (`xl`, XlRecipe): eagle2-mixed-xl's data

With `regenerate`, the target first answers every prompt itself (batched; docs/spec.md §1: the
head then learns the target's own distribution rather than the data set's responses), and the
answers are put back in the drawn order, so a prefix of a domain is still a random draw. Features
are computed once per domain; the mixtures reuse prefixes of them (a smaller draw is a prefix of a
larger one). Every stage is resumable: rerunning the command skips finished data, features and drafters and resumes an interrupted training from its last checkpoint.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from taps.core import workers
from taps.data.features import FeatureSettings, extract_features, read_conversations
from taps.data.mix import mix_sources
from taps.data.regenerate import RegenerateSettings, regenerate
from taps.data.sources import first_user_turn
from taps.core.jsonl import read_json, read_jsonl, write_json_atomic, write_jsonl
from taps.core.target import Target
from taps.train.trainer import TrainConfig, Trainer, writer_lock

DOMAINS = ("chat", "math", "mixed-small", "mixed-large")  # the family: a recipe's default domains
ALL_DOMAINS = DOMAINS + ("mixed-xl",)  # mixed-xl needs the recipe's `xl` and regeneration
BACKBONES = ("eagle2", "hass", "eagle3")


@dataclass(frozen=True)
class XlRecipe:
    """The mixed-xl head's data and training, apart from the family's N per domain (defaults:
    eagle2-mixed-xl's recipe, models/smollm2-135m-instruct/README.md). Its chat data is
    `chat_count` English conversations of the recipe's chat source drawn with `seed`, those whose
    first prompt is longer than `chat_max_prompt_chars` taken out after the draw; its math data
    `math_count` records of the math source (None: all). The target answers both, shortest prompt
    first when batched, and the first `chat_limit` / `math_limit` answers are kept, in that order
    (a GPU's time limit cut the original there). One head then trains on both with its own epochs,
    batch size and warm-up (more data takes a larger batch; on a CPU, where an EAGLE-3 batch of 8
    already holds about 12 GB, `grad_accum` micro-batches make the same global batch of
    batch_size x grad_accum). Its features are cut at `max_len` tokens (2,048: none is cut, as none
    of the original's were; a prompt of at most 384 tokens and an answer of at most 384 fit). The original run planned 5 epochs and was cut after 3 with the learning rate
    not yet decayed; `epochs` 3 here is a whole schedule. `shipped_data` ({chat, math}: file) names
    the answers shipped with the heads: present, they skip regeneration."""
    seed: int = 15
    chat_count: int = 12000
    chat_max_prompt_chars: int | None = 1600
    chat_limit: int | None = 8192
    math_count: int | None = None
    math_limit: int | None = 6144
    epochs: int = 3
    batch_size: int = 32
    grad_accum: int = 1
    warmup_steps: int = 200
    max_len: int = 2048
    shipped_data: dict | None = None


def xl_recipe(recipe: "DrafterRecipe") -> XlRecipe:
    """The recipe's `xl` mapping as an XlRecipe; an unknown key is refused by name."""
    if not isinstance(recipe.xl, dict):
        raise ValueError(f"mixed-xl needs the recipe's xl settings (a mapping of {', '.join(XlRecipe.__dataclass_fields__)})")
    unknown = sorted(set(recipe.xl) - set(XlRecipe.__dataclass_fields__))
    if unknown:
        raise ValueError(f"xl: unknown key {unknown[0]!r}; expected one of {', '.join(XlRecipe.__dataclass_fields__)}")
    xl = XlRecipe(**recipe.xl)
    _check_shipped("xl.shipped_data", xl.shipped_data)
    return xl


def _check_shipped(where: str, shipped) -> None:
    if shipped is None:
        return
    if not isinstance(shipped, dict) or set(shipped) - {"chat", "math"} or \
            not all(isinstance(v, str) and v for v in shipped.values()):
        raise ValueError(f"{where} must map chat and / or math to a file, got {shipped!r}")


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
    backbones: tuple[str, ...] = ("eagle2", "hass")  # the shipped family; add "eagle3" for its EAGLE-3 heads
    domains: tuple[str, ...] = DOMAINS
    threads: int | None = None
    device: str = "cpu"  # the target's device for features and training ("auto" takes a GPU)
    dtype: str = "float32"  # the target's weights
    feature_dtype: str = "fp32"  # stored features: fp32 for exact CPU runs, bf16 at 8B scale
    mixed_precision: str = "no"  # the heads' training: "bf16" autocast on GPUs
    compile_loss: bool = False  # torch.compile the heads' vocabulary-sized loss terms
    checkpoint_steps: int | None = 100  # besides every epoch end, so a killed run loses little
    # regeneration: the target answers the drawn prompts itself before features are extracted
    regenerate: bool = False
    regen_batch_size: int = 64  # records per transformers generate call
    regen_max_new_tokens: int | dict = 512  # per answer; or {chat: N, math: M}
    regen_max_turns: int | None = None  # keep the first K user turns of each conversation
    regen_max_prompt_tokens: int | None = None  # skip records whose first prompt is longer
    regen_temperature: float = 0.0
    # {chat: PATH, math: PATH}: the target's answers to this draw, regenerated once and shipped
    # (models/<target>/data/<domain>.train.jsonl.gz, in the drawn order); a domain whose file is
    # present skips regeneration, one whose file is absent regenerates as without it
    shipped_data: dict | None = None
    draft_vocab: int | None = None  # train each head over the N most frequent tokens of its data (None: all)
    keep_epoch_heads: bool = False  # keep every epoch's head in the work directory (learning curves)
    xl: dict | None = None  # XlRecipe fields: the mixed-xl head's own draw, cut and training


def log(msg: str) -> None:
    print(f"[drafters {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# the source domains each training set draws from (xl-chat / xl-math: mixed-xl's own draws)
SOURCES = {"chat": ("chat",), "math": ("math",), "mixed-small": ("chat", "math"), "mixed-large": ("chat", "math"),
           "mixed-xl": ("xl-chat", "xl-math")}
SOURCE_NAMES = ("chat", "math", "xl-chat", "xl-math")


@dataclass(frozen=True)
class _Draw:
    """How one source domain's records are drawn and answered."""
    spec: str  # SOURCE[:COUNT]
    seed: int
    english: bool
    max_prompt_chars: int | None = None
    limit: int | None = None  # answers kept, in answer order (None: every drawn record, in drawn order)
    shipped: str | None = None


def _draw(recipe: DrafterRecipe, source: str) -> _Draw:
    kind = source.removeprefix("xl-")  # chat or math: the data set and the answer length
    if source in ("chat", "math"):
        spec = recipe.chat_source if kind == "chat" else recipe.math_source
        return _Draw(f"{spec}:{recipe.n_per_domain}", recipe.seed, kind == "chat",
                     shipped=(recipe.shipped_data or {}).get(kind))
    xl = xl_recipe(recipe)
    shipped = (xl.shipped_data or {}).get(kind)
    if kind == "chat":
        return _Draw(f"{recipe.chat_source}:{xl.chat_count}", xl.seed, True, xl.chat_max_prompt_chars, xl.chat_limit,
                     shipped)
    spec = recipe.math_source if xl.math_count is None else f"{recipe.math_source}:{xl.math_count}"
    return _Draw(spec, xl.seed, False, None, xl.math_limit, shipped)


def _domain_data(recipe: DrafterRecipe, work: Path, target=None, sources=("chat", "math")) -> dict[str, Path]:
    files = {}
    for source in SOURCE_NAMES:
        if source not in sources:
            continue
        draw = _draw(recipe, source)
        path = work / f"{source}.jsonl"
        if not path.is_file():
            records = mix_sources([draw.spec], draw.seed, recipe.data_dir, english=draw.english,
                                  on_report=lambda r: log(str(r)), max_prompt_chars=draw.max_prompt_chars)
            write_jsonl(records, path)
            log(f"{source}: {len(records)} records -> {path}")
        files[source] = _regenerated(recipe, target, source, path, draw) if recipe.regenerate else path
    return files


def _regenerated(recipe: DrafterRecipe, target, domain: str, data: Path, draw: _Draw) -> Path:
    """The domain's records answered by the target (resumable): in the order of `data`, or, with a
    limit, the first `limit` in the order they were answered (shortest prompt first when batched)."""
    ordered = data.with_name(f"{domain}.train.jsonl")
    if ordered.is_file():
        return ordered
    if draw.shipped and Path(draw.shipped).is_file():
        kept = shipped_answers(Path(draw.shipped), data, drawn_order=draw.limit is None, limit=draw.limit)
        write_jsonl(kept, ordered)
        log(f"{domain}: {len(kept)} regenerated records from {draw.shipped} (shipped: regeneration skipped) -> {ordered}")
        return ordered
    if draw.shipped:
        log(f"{domain}: {draw.shipped} is absent: regenerating")
    answers = data.with_name(f"{domain}.regenerated.jsonl")
    kind, tokens = domain.removeprefix("xl-"), recipe.regen_max_new_tokens
    settings = RegenerateSettings(max_new_tokens=int(tokens[kind] if isinstance(tokens, dict) else tokens),
                                  temperature=recipe.regen_temperature, seed=recipe.seed,
                                  batch_size=recipe.regen_batch_size, max_turns=recipe.regen_max_turns,
                                  max_prompt_tokens=recipe.regen_max_prompt_tokens, limit=draw.limit)
    log(f"{domain}: regenerating the answers with the target ({settings})")
    regenerate(target, data, answers, settings)
    if draw.limit is None:
        by_id = {str(r["id"]): r for r in read_conversations(answers)}
        kept = [by_id[str(r["id"])] for r in read_conversations(data) if str(r["id"]) in by_id]
    else:  # the cut is by answer order: keep it
        kept = read_conversations(answers)
    write_jsonl(kept, ordered)  # atomically: its presence means the domain's regeneration is complete
    log(f"{domain}: {len(kept)} regenerated records -> {ordered}")
    return ordered


def shipped_answers(shipped: Path, data: Path, drawn_order: bool = True, limit: int | None = None) -> list[dict]:
    """The shipped regenerated records, checked against this draw: each answers a drawn record (same
    id, same first user turn) once, they keep the drawn order when `drawn_order` (records the recipe
    skipped, such as over-long prompts, are absent), and there are at most `limit`. Another draw
    (seed, source, N) is refused naming the line."""
    drawn = {str(r["id"]): (i, first_user_turn(r)) for i, r in enumerate(read_conversations(data))}
    records, last, seen = read_conversations(shipped), -1, set()
    if limit is not None and len(records) > limit:
        raise ValueError(f"{shipped}: {len(records):,} records, more than this recipe's limit of {limit:,}")
    for line, record in enumerate(records, start=1):
        rid = str(record.get("id"))
        if rid not in drawn:
            raise ValueError(f"{shipped}:{line}: record id {rid!r} is not in this draw ({data}); the shipped data "
                             "belongs to another recipe (source, n_per_domain or seed)")
        index, prompt = drawn[rid]
        if first_user_turn(record) != prompt:
            raise ValueError(f"{shipped}:{line}: record {rid!r} answers another prompt than the drawn one in {data}")
        if rid in seen:
            raise ValueError(f"{shipped}:{line}: record {rid!r} appears twice")
        if drawn_order and index <= last:
            raise ValueError(f"{shipped}:{line}: record {rid!r} is out of the drawn order of {data}")
        last = index
        seen.add(rid)
    return records


def feature_specs(domain: str, work: Path, backbone: str, n: int) -> list[str]:
    """The features each training set uses: whole domains, or the first N/2 of each."""
    features = {source: feature_dir(work, source, backbone) for source in SOURCE_NAMES}
    if domain == "mixed-small":
        return [f"{features['chat']}:{n // 2}", f"{features['math']}:{n // 2}"]
    return [str(features[source]) for source in SOURCES[domain]]


# HASS's three aligned steps cost ~3x EAGLE-2 per token: bench/train_speed.py measured 3.6x (fp32) and
# 3.8x (bf16) on dense random batches on an AMD Zen 5 core, while an earlier build's logs (bf16, real
# features, an AMX CPU) read nearer 1.3x. Only the order of the heads depends on it (longest_first).
HASS_COST = 3.0
# EAGLE-3's training-time test unrolls 7 steps (HASS: 3) over a wider input: a guess, not yet measured
# on a quiet machine; like HASS_COST it only orders the heads.
EAGLE3_COST = 5.0


def head_costs(tokens: dict[str, int]) -> dict[tuple[str, str], float]:
    """Relative training cost of every (backbone, domain) head from the domains' feature tokens,
    for balancing heads over worker processes."""
    chat, math = tokens.get("chat", 0), tokens.get("math", 0)
    per_domain = {"chat": chat, "math": math, "mixed-small": (chat + math) / 2, "mixed-large": chat + math,
                  "mixed-xl": tokens.get("xl-chat", 0) + tokens.get("xl-math", 0)}
    cost = {"hass": HASS_COST, "eagle3": EAGLE3_COST}
    return {(b, d): per_domain[d] * cost.get(b, 1.0) for b in BACKBONES for d in ALL_DOMAINS}


def longest_first(heads: list[tuple[str, str]], costs: dict[tuple[str, str], float]) -> list[tuple[str, str]]:
    """The order workers take heads in. Each worker takes the next head when it finishes one, so
    longest first keeps any worker from ending far after the others (the LPT rule) even when the
    cost model is off: it only orders the heads, it does not fix who trains which."""
    return sorted(heads, key=lambda h: -costs[h])


@contextmanager
def _locked(path: Path):
    """An exclusive lock on PATH, so worker processes update drafters.json one at a time."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_summary(out: Path) -> dict:
    path = out / "drafters.json"
    if not path.is_file():
        return {}
    return read_json(path, "the summary of this family's heads (fix or delete it: the heads themselves are kept)",
                     ValueError)


# what a head's weights depend on besides the target: heads of one OUT must share them, as a build
# may span sessions (backbones, domains, jobs, threads, device, checkpointing and --compile may differ)
HEAD_FIELDS = ("chat_source", "math_source", "n_per_domain", "max_len", "epochs", "lr", "batch_size",
               "warmup_steps", "seed", "dtype", "feature_dtype", "mixed_precision", "regenerate",
               "regen_max_new_tokens", "regen_max_turns", "regen_max_prompt_tokens", "regen_temperature",
               "draft_vocab", "xl")


def check_same_recipe(out: Path, recipe: DrafterRecipe) -> None:
    """Refuse to add heads to OUT under other training settings than its finished heads had: the
    set would silently mix two recipes (a per-head record cannot tell which)."""
    summary = _read_summary(out)
    saved = summary.get("recipe", {})
    if not summary.get("drafters"):
        return
    has_xl = any(name.endswith("-mixed-xl") for name in summary["drafters"])
    for key in HEAD_FIELDS:
        if key == "xl" and not has_xl:  # only the mixed-xl heads depend on it
            continue
        if key in saved and saved[key] != getattr(recipe, key):
            raise ValueError(f"{out / 'drafters.json'}: its heads were trained with {key} = {saved[key]!r}, this run "
                             f"has {getattr(recipe, key)!r}; use the same setting or another --out")


def _is_done(out: Path, name: str) -> bool:
    return (out / name / "model.safetensors").is_file() and name in _read_summary(out).get("drafters", {})


def _record(out: Path, recipe: DrafterRecipe, name: str | None = None, entry: dict | None = None) -> dict:

    out.mkdir(parents=True, exist_ok=True)
    with _locked(out / "drafters.json.lock"):
        summary = _read_summary(out)
        summary["recipe"] = asdict(recipe)
        if name is not None:
            summary.setdefault("drafters", {})[name] = entry
        write_json_atomic(out / "drafters.json", summary)
    return summary


def feature_dir(work: Path, domain: str, backbone: str) -> Path:
    """EAGLE-3 heads read the target's low / middle / high layers too: their features live apart, so
    the EAGLE-2 / HASS features (and their resumes) stay what they were."""
    return work / (f"features-aux-{domain}" if backbone == "eagle3" else f"features-{domain}")


def _features(recipe: DrafterRecipe, target, work: Path, sources=SOURCE_NAMES,
              backbones: tuple[str, ...] = ("eagle2",)) -> dict[str, int]:
    """Data and features of the source domains (skipped when done) for the pending heads'
    backbones: their token counts. Only the domains the pending heads draw from are prepared, so
    the math heads can train while the chat data is still being regenerated elsewhere."""
    tokens = {}
    kinds = sorted({"eagle3" if b == "eagle3" else "eagle2" for b in backbones})
    for domain, path in _domain_data(recipe, work, target, sources).items():
        for kind in kinds:
            max_len = xl_recipe(recipe).max_len if domain.startswith("xl-") else recipe.max_len
            settings = FeatureSettings(max_len=max_len, dtype=recipe.feature_dtype,
                                       aux_layers="auto" if kind == "eagle3" else "")
            manifest = extract_features(target, path, feature_dir(work, domain, kind), settings)
            tokens[domain] = int(manifest["tokens"])
            log(f"features {domain} ({kind}): {manifest['records_done']} records, {manifest['tokens']:,} tokens, "
                f"{manifest['assistant_tokens']:,} assistant tokens")
    return tokens


def _train_head(recipe: DrafterRecipe, target, out: Path, work: Path, backbone: str, domain: str,
                progress: bool = True) -> None:
    from accelerate import Accelerator


    name = f"{backbone}-{domain}"
    xl = xl_recipe(recipe) if domain == "mixed-xl" else None
    epochs, batch_size, accum, warmup = (xl.epochs, xl.batch_size, xl.grad_accum, xl.warmup_steps) if xl else \
        (recipe.epochs, recipe.batch_size, 1, recipe.warmup_steps)
    cfg = TrainConfig(backbone=backbone, epochs=epochs, lr=recipe.lr, batch_size=batch_size, grad_accum=accum,
                      warmup_steps=warmup, seed=recipe.seed, training_data=domain,
                      checkpoint_steps=recipe.checkpoint_steps, mixed_precision=recipe.mixed_precision,
                      compile_loss=recipe.compile_loss, draft_vocab=recipe.draft_vocab,
                      keep_epoch_heads=recipe.keep_epoch_heads)
    run_dir = work / f"train-{name}"  # checkpoints stay in the work directory
    # the heads train where the target is: a CPU target on a GPU machine keeps accelerate off the GPU
    # (cpu=False is accelerate's default, so CPU-only machines see no difference)
    acc = Accelerator(mixed_precision=recipe.mixed_precision, cpu=target.device.type == "cpu" and torch.cuda.is_available())
    t0 = time.time()
    with writer_lock(run_dir):
        trainer = Trainer(target, feature_specs(domain, work, backbone, recipe.n_per_domain), run_dir, cfg,
                          accelerator=acc)
        if trainer.resume():
            log(f"{name}: resumed at step {trainer.step}/{trainer.total_steps}")
        else:
            log(f"{name}: training, {trainer.total_steps} steps")
        t0 = time.time()
        trainer.fit(progress=progress)
    head_dir = out / name
    head_dir.mkdir(parents=True, exist_ok=True)
    for file in ("config.json", "metrics.jsonl", "model.safetensors"):  # the shipped drafter: no optimizer
        # weights last and atomically: a reader (drafter-table, a test) that sees model.safetensors sees all of it
        shutil.copyfile(run_dir / file, head_dir / f"{file}.tmp")
        os.replace(head_dir / f"{file}.tmp", head_dir / file)
    epochs = [row for _, row in read_jsonl(run_dir / "metrics.jsonl")[0] if "heldout_loss" in row]
    entry = {"records": len(trainer.shards), "features": trainer.shards.description, "steps": trainer.step,
             "wall_time_s_last_run": round(time.time() - t0, 1), "train_seconds": round(trainer.train_seconds, 1),
             "timed_from_step": trainer.timed_from_step, "final": epochs[-1] if epochs else {}}
    vocab = getattr(trainer, "draft_vocab", None)
    if vocab is not None:
        entry["draft_vocab"] = {"size": int(vocab.ids.numel()), "coverage": round(vocab.coverage, 6)}
    _record(out, recipe, name, entry)
    log(f"{name}: {entry['final']}")


def _worker(recipe: DrafterRecipe, target_dir: str, out: str, work: str, order: list, taken, threads: int,
            index: int) -> None:
    """One process of `--jobs N`: takes the next untaken head of `order` (a shared counter) until
    none is left, with its share of the cores."""
    torch.set_num_threads(threads)
    target = Target.load(target_dir, device=recipe.device, dtype=recipe.dtype)
    for backbone, domain in workers.untaken(order, taken):  # the features the heads need exist
        log(f"worker {index}: {backbone}-{domain}")
        _train_head(recipe, target, Path(out), Path(work), backbone, domain, progress=False)


def _run_workers(recipe: DrafterRecipe, target_dir, out: Path, work: Path, order: list, jobs: int) -> None:
    jobs = min(jobs, len(order))
    threads = recipe.threads or workers.cores_each(jobs)
    taken = workers.counter()  # heads of `order` handed out so far
    log(f"{jobs} workers ({threads} thread(s) each) take the heads in this order: "
        f"{', '.join(f'{b}-{d}' for b, d in order)}")
    workers.join(workers.start(_worker, [(recipe, str(target_dir), str(out), str(work), order, taken, threads, i)
                                         for i in range(jobs)]))
    failed = [f"{b}-{d}" for b, d in order if not _is_done(out, f"{b}-{d}")]
    if failed:
        raise RuntimeError(f"drafter training failed for {', '.join(failed)} (see the worker's traceback above); "
                           f"rerun the same command to resume from the last checkpoints")


def build_drafters(recipe: DrafterRecipe, target_dir: str | Path, out: str | Path, work: str | Path,
                   jobs: int = 1) -> dict:
    """Train every (backbone, domain) head not yet in OUT; `jobs` > 1 trains them in that many
    processes at once, each taking the next head, longest first, when it finishes one (on a CPU one
    thread each beats two threads per head)."""
    out, work = Path(out), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    if recipe.threads and jobs == 1:
        torch.set_num_threads(recipe.threads)
    # with --jobs, --threads is each worker's: the features (one process, before the workers) use every core
    unknown = set(recipe.domains) - set(ALL_DOMAINS) | set(recipe.backbones) - set(BACKBONES)
    if unknown:
        raise ValueError(f"unknown domain or backbone {sorted(unknown)}; domains: {ALL_DOMAINS}, backbones: {BACKBONES}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    _check_shipped("shipped_data", recipe.shipped_data or {})
    if "mixed-xl" in recipe.domains:
        xl_recipe(recipe)
        if not recipe.regenerate:
            raise ValueError("mixed-xl is cut by answer order: it needs regenerate: true")
    check_same_recipe(out, recipe)
    pending = []
    for backbone in recipe.backbones:
        for domain in recipe.domains:
            if _is_done(out, f"{backbone}-{domain}"):
                log(f"{backbone}-{domain}: done, skipped")
            else:
                pending.append((backbone, domain))
    if not pending:
        return _record(out, recipe)
    target = Target.load(target_dir, device=recipe.device, dtype=recipe.dtype)
    sources = tuple(s for s in SOURCE_NAMES if any(s in SOURCES[domain] for _, domain in pending))
    tokens = _features(recipe, target, work, sources, tuple(b for b, _ in pending))
    if jobs > 1 and len(pending) > 1:
        del target
        _run_workers(recipe, target_dir, out, work, longest_first(pending, head_costs(tokens)), jobs)
    else:
        if recipe.threads:
            torch.set_num_threads(recipe.threads)
        for backbone, domain in pending:
            _train_head(recipe, target, out, work, backbone, domain)
    return _record(out, recipe)


def ship_data(work: str | Path, dest: str | Path, domains: tuple[str, ...] = ("chat", "math")) -> list[Path]:
    """The regenerated training data of a build (WORK/<domain>.train.jsonl) as DEST/<domain>.train.jsonl.gz,
    the files a recipe's `shipped_data` names: a clean clone then rebuilds features and heads without
    regenerating (gzip written without a time stamp: the same records give the same bytes)."""
    written = []
    for domain in domains:
        source = Path(work) / f"{domain}.train.jsonl"
        if not source.is_file():
            raise FileNotFoundError(f"{source}: no regenerated {domain} data in this build (run its data stage first)")
        written.append(write_jsonl(read_conversations(source), Path(dest) / f"{domain}.train.jsonl.gz"))
    return written


def ship_heads(out: str | Path, dest: str | Path, dtype: str = "bfloat16", names: tuple[str, ...] | None = None) -> list[str]:
    """Copy a family's finished heads for shipping: config.json, metrics.jsonl and the weights cast
    to `dtype` (integer and bool tensors, such as a draft vocabulary's d2t / t2d, kept as they are),
    plus drafters.json. No optimizer state, no embedding, no LM head. Each file is replaced atomically."""
    out, dest = Path(out), Path(dest)
    cast = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if dtype not in cast:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(cast)}")
    summary = _read_summary(out)
    shipped = [n for n in (names or tuple(summary.get("drafters", {}))) if _is_done(out, n)]
    for name in shipped:
        src, dst = out / name, dest / name
        dst.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.to(cast[dtype]) if v.is_floating_point() else v
                   for k, v in load_file(src / "model.safetensors").items()}
        save_file(tensors, dst / "model.safetensors.tmp", metadata={"format": "pt"})
        os.replace(dst / "model.safetensors.tmp", dst / "model.safetensors")
        for file in ("config.json", "metrics.jsonl"):
            shutil.copyfile(src / file, dst / f"{file}.tmp")
            os.replace(dst / f"{file}.tmp", dst / file)

    write_json_atomic(dest / "drafters.json", {**summary, "drafters": {n: summary["drafters"][n] for n in shipped},
                                               "shipped_dtype": dtype})
    return shipped
