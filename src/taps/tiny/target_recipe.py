"""Recipe for the tiny chat+math target: corpus -> tokenizer -> packed blocks -> LM training -> save.

The target is a small LlamaForCausalLM trained on whole conversations from English ShareGPT
(chat) and GSM8K train (math), a fixed share of every batch from each domain (half by default),
so both are well represented whatever their sizes. Training blocks are cut anywhere in the packed
corpus or (pack="conversations") each at a conversation's start. Everything derives from the seed:
the held-out split, the tokenizer, the packing order and the batch order (block k of a domain is
a pure function of k), so an interrupted run resumes from its last checkpoint to the same weights;
a resume with other data or training settings is refused, naming the setting.

Work directory (resumable):      out directory (the shipped model):
    split.json  tokenizer/           config.json  model.safetensors (bf16)
    tokens-*.npy  starts-*.npy       tokenizer.json  tokenizer_config.json
    ckpt/step-*/  ckpt/latest        generation_config.json  recipe.json
    log.jsonl
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from taps.tiny.lm_objective import lm_loss
from taps.tiny.seq_unlikelihood import answer_prompts, sequence_unlikelihood
from taps.tiny.tokenizer import END_OF_TURN, ROLE_TOKENS, save_tokenizer, train_tokenizer
from taps.train.state import latest_checkpoint, load_checkpoint, save_checkpoint

DOMAINS = ("chat", "math")


@dataclass
class TargetRecipe:
    data_dir: str | None = None  # laid out like ../shared/data (gsm8k/train.jsonl); else TAPS_DATA_DIR
    chat_source: str = "sharegpt"  # source spec of the chat domain (English conversations are kept)
    math_source: str = "gsm8k:train"
    seed: int = 0
    vocab_size: int = 8192
    hidden_size: int = 256
    layers: int = 6
    heads: int = 4
    kv_heads: int = 4
    intermediate_size: int = 704
    max_positions: int = 2048
    seq_len: int = 512
    pack: str = "stream"  # training blocks: "stream" (any offset) or "conversations" (each starts a conversation)
    batch_size: int = 8  # sequences per step
    math_share: float = 0.5  # of each batch; both domains always get at least one sequence
    steps: int = 2000
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    unlikelihood: float = 0.0  # weight of token-level unlikelihood against earlier tokens (0: plain cross-entropy)
    seq_unlikelihood: float = 0.0  # weight of sequence-level unlikelihood on the model's own greedy chat answers
    seq_prompts: int = 8  # chat questions of each batch answered greedily for it
    seq_new_tokens: int = 128  # tokens of each of those answers
    minutes: float | None = None  # wall-clock cap; the run stops early (and says so) when it is hit
    eval_every: int = 200
    ckpt_every: int = 100
    eval_blocks: int = 32  # held-out blocks per domain per evaluation
    holdout_frac: float = 0.02
    chat_max_tokens: int = 768  # long ShareGPT conversations are cut: first turns matter most
    chat_max_answer_words: int | None = None  # drop chat conversations with a longer assistant turn
    chat_drop_code: bool = False  # drop chat conversations with a code fence in an assistant turn
    tokenizer_chars: int = 30_000_000  # text used to train the tokenizer, split evenly across domains
    limit_per_domain: int | None = None  # toy runs
    init_from: str | None = None  # continue training a target built by this recipe (its tokenizer, weights, split)
    threads: int | None = None
    device: str = "cpu"  # "auto": a GPU when there is one
    mixed_precision: str = "no"  # "bf16": autocast the forward (GPUs, AMX CPUs); weights and optimizer stay fp32
    extra: dict = field(default_factory=dict)


def log(msg: str) -> None:
    print(f"[tiny-target {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- corpus ---------------------------------------------------------------------------------------
def load_domains(recipe: TargetRecipe) -> dict[str, list[dict]]:
    from taps.data.sources import english_only, load_source

    chat, chat_report = load_source(recipe.chat_source, recipe.data_dir)
    log(f"chat: {chat_report}")
    chat = english_only(chat)
    log(f"chat: {len(chat)} English conversations kept")
    math_records, math_report = load_source(recipe.math_source, recipe.data_dir)
    log(f"math: {math_report}")
    domains = {"chat": chat, "math": math_records}
    if recipe.limit_per_domain:
        domains = {d: r[: recipe.limit_per_domain] for d, r in domains.items()}
    return domains


def split_domains(domains: dict[str, list[dict]], frac: float, seed: int) -> dict[str, dict[str, list[dict]]]:
    """Deterministic train / held-out split per domain."""
    out = {}
    for d, records in domains.items():
        order = list(range(len(records)))
        random.Random(f"{seed}-{d}").shuffle(order)
        n_hold = max(1, round(frac * len(records)))
        out[d] = {"heldout": [records[i] for i in order[:n_hold]], "train": [records[i] for i in order[n_hold:]]}
    return out


def keep_chat(record: dict, max_answer_words: int | None, drop_code: bool) -> bool:
    """Whether a chat conversation passes the recipe's filters: every assistant turn at most
    `max_answer_words` words and, with `drop_code`, free of code fences: a simpler chat domain for a
    small model (on the embedded default it did not make greedy answers loop less: model card, v2/v3)."""
    for turn in record["conversations"]:
        if turn["role"] != "assistant":
            continue
        if drop_code and "```" in turn["content"]:
            return False
        if max_answer_words is not None and len(turn["content"].split()) > max_answer_words:
            return False
    return True


def filter_chat(splits, recipe: TargetRecipe) -> None:
    """Apply the chat filters to both halves of the split, in place. Filtering after the split keeps
    the held-out records of an unfiltered run with the same seed out of training (--init-from)."""
    if recipe.chat_max_answer_words is None and not recipe.chat_drop_code:
        return
    for half, records in splits["chat"].items():
        kept = [r for r in records if keep_chat(r, recipe.chat_max_answer_words, recipe.chat_drop_code)]
        log(f"chat/{half}: {len(kept)} of {len(records)} conversations pass the filters "
            f"(answers <= {recipe.chat_max_answer_words} words, drop code: {recipe.chat_drop_code})")
        if not kept:
            raise ValueError(f"chat/{half}: no conversation passes --chat-max-answer-words "
                             f"{recipe.chat_max_answer_words} / --chat-drop-code; loosen them")
        splits["chat"][half] = kept


def tokenizer_texts(splits, budget_chars: int):
    """Training text for the tokenizer: train-split turns, up to budget_chars per domain share."""
    share = budget_chars // len(splits)
    for d in splits:
        used = 0
        for record in splits[d]["train"]:
            for turn in record["conversations"]:
                yield turn["content"]
                used += len(turn["content"])
            if used >= share:
                break


def encode_domain(tokenizer, records: list[dict], max_tokens: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Render each conversation with the chat template, tokenize, cut, concatenate.
    Returns the tokens [n_tokens] int32 and each conversation's start offset [n_records] int64."""
    texts = [tokenizer.apply_chat_template(r["conversations"], tokenize=False) for r in records]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    if max_tokens:
        ids = [x[:max_tokens] for x in ids]
    starts = np.cumsum([0] + [len(x) for x in ids[:-1]], dtype=np.int64)
    return np.fromiter((t for x in ids for t in x), dtype=np.int32), starts


def conversation_block_starts(starts: np.ndarray, n_tokens: int, seq_len: int) -> np.ndarray:
    """Offsets of blocks that each begin at a conversation start and do not overlap: a block holds
    the conversations that follow its start, the last one cut at the block's end (its rest is not
    trained on). So every answer in a block sees its question, which a block at an arbitrary offset
    often cuts away. [n_blocks] int64"""
    out, end = [], 0
    for s in starts.tolist():
        if s >= end and s + seq_len <= n_tokens:
            out.append(s)
            end = s + seq_len
    return np.asarray(out, dtype=np.int64)


class BlockStream:
    """Fixed-length blocks of a packed token array; block k is a pure function of (seed, k), so
    training resumes at any step with no stored data position."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, block_starts: np.ndarray | None = None):
        """block_starts=None: consecutive blocks from offset 0; else the blocks at these offsets."""
        if block_starts is None:
            block_starts = np.arange(len(tokens) // seq_len, dtype=np.int64) * seq_len
        if len(block_starts) == 0:
            raise ValueError(f"only {len(tokens)} tokens: not one block of {seq_len}")
        index = block_starts[:, None] + np.arange(seq_len)[None, :]  # [n, seq_len]
        self.blocks = torch.from_numpy(tokens[index].astype(np.int64))  # [n, seq_len]
        self.seed = seed

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def take(self, start: int, count: int) -> torch.Tensor:  # [count, seq_len]
        rows = []
        for k in range(start, start + count):
            epoch, i = divmod(k, len(self))
            perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
            rows.append(self.blocks[perm[i]])
        return torch.stack(rows)


# ---- model and schedule ---------------------------------------------------------------------------
def build_model(recipe: TargetRecipe, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    if recipe.init_from:
        model = LlamaForCausalLM.from_pretrained(recipe.init_from, dtype=torch.float32)
        if model.config.vocab_size != len(tokenizer):
            raise ValueError(f"{recipe.init_from}: vocabulary {model.config.vocab_size} != tokenizer {len(tokenizer)}")
        return model

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads, num_key_value_heads=recipe.kv_heads,
        max_position_embeddings=recipe.max_positions, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TURN)],
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.02,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        return LlamaForCausalLM(config)


def sequences_per_domain(recipe: TargetRecipe) -> dict[str, int]:
    """How many of each batch's sequences come from each domain (the split is fixed per step, so
    both domains are represented in every batch whatever their corpus sizes)."""
    math = round(recipe.batch_size * recipe.math_share)
    split = {"chat": recipe.batch_size - math, "math": math}
    if min(split.values()) < 1:
        raise ValueError(f"batch_size {recipe.batch_size} with math_share {recipe.math_share} leaves a domain "
                         f"without sequences ({split}); both domains need at least one per batch")
    return split


def learning_rate(recipe: TargetRecipe, step: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak at `steps`."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = min(1.0, (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup))
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: this torch build sees no GPU; use --device cpu or auto")
    return device


def autocast(device: torch.device, mixed_precision: str):
    if mixed_precision not in ("no", "bf16"):
        raise ValueError(f"mixed_precision {mixed_precision!r}: expected 'no' or 'bf16'")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=mixed_precision == "bf16")


@torch.no_grad()
def heldout_loss(model, stream: BlockStream, blocks: int, batch: int = 8, mixed_precision: str = "no") -> float:
    model.eval()
    device = next(model.parameters()).device
    losses = []
    for start in range(0, min(blocks, len(stream)), batch):
        x = stream.blocks[start:start + min(batch, blocks - start)].to(device)
        with autocast(device, mixed_precision):
            losses.append(float(model(input_ids=x, labels=x).loss) * x.shape[0])
    model.train()
    return sum(losses) / min(blocks, len(stream))


# ---- the recipe -----------------------------------------------------------------------------------
DATA_FIELDS = ("chat_source", "math_source", "seed", "vocab_size", "holdout_frac", "chat_max_tokens",
               "chat_max_answer_words", "chat_drop_code", "tokenizer_chars", "limit_per_domain", "init_from")


# what a checkpoint's weights and optimizer state depend on besides the data: a resume must keep them
# (`steps` may change, to extend or shorten a run, but not to below the checkpoint's own step;
# `minutes`, threads, device and autocast may change freely)
TRAIN_FIELDS = ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size", "max_positions", "seq_len",
                "pack", "batch_size", "math_share", "lr", "warmup", "weight_decay", "unlikelihood",
                "seq_unlikelihood", "seq_prompts", "seq_new_tokens")


def check_resume_settings(recipe: TargetRecipe, ckpt: Path) -> None:
    """Resuming `ckpt` with other training settings would silently train another model from the
    middle of this one (other blocks, shapes or schedule), so it is refused by key. Checkpoints
    written before the settings were recorded are taken as they are."""
    state = json.loads((ckpt / "state.json").read_text())
    if int(state.get("step", 0)) > recipe.steps:
        raise ValueError(f"{ckpt}: this checkpoint is at step {state['step']}, past this run's --steps {recipe.steps}; "
                         f"resume with --steps >= {state['step']}, or use another --work")
    saved = state.get("extra", {}).get("train_settings", {})
    for key in TRAIN_FIELDS:
        if key in saved and saved[key] != getattr(recipe, key):
            raise ValueError(f"{ckpt}: this checkpoint was trained with {key} = {saved[key]!r}, this run has "
                             f"{getattr(recipe, key)!r}; resume with the same setting, use another --work, or "
                             "continue a finished target with new settings through --init-from")


def trim_log(path: Path, step: int) -> None:
    """Keep the log entries of steps up to `step` (the checkpoint resumed; 0: a fresh start), so
    the log describes the weights: entries of an interrupted stretch past it would repeat."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def check_data_settings(recipe: TargetRecipe, work: Path) -> None:
    """The cached split, tokenizer and token arrays in `work` were made with these settings: a rerun
    with other ones would silently train on the old data, so it is refused (work dirs made before
    this record existed are taken as they are)."""
    path = work / "data-settings.json"
    cached = json.loads(path.read_text()) if path.is_file() else {}
    for key in DATA_FIELDS:
        if key in cached and cached[key] != getattr(recipe, key):
            raise ValueError(f"{path}: the cached data of this work directory was made with {key} = "
                             f"{cached[key]!r}, this run has {getattr(recipe, key)!r}; use another --work "
                             "(or the same setting)")


def prepare(recipe: TargetRecipe, work: Path):
    """Split, tokenizer and packed token arrays, each cached in the work directory."""
    from transformers import AutoTokenizer

    tok_dir = work / "tokenizer"
    arrays = {(d, s): work / f"tokens-{d}-{s}.npy" for d in DOMAINS for s in ("train", "heldout")}
    starts = {k: p.with_name(p.name.replace("tokens-", "starts-")) for k, p in arrays.items()}
    if tok_dir.is_dir() and all(p.is_file() for p in arrays.values()):
        check_data_settings(recipe, work)
        missing = [str(p) for p in starts.values() if not p.is_file()]
        if recipe.pack == "conversations" and missing:
            raise ValueError(f"{missing[0]}: missing (this work directory predates conversation packing); "
                             "use another --work or --pack stream")
        log(f"reusing tokenizer and token arrays in {work}")
        return AutoTokenizer.from_pretrained(tok_dir), {k: np.load(p) for k, p in arrays.items()}, \
            {k: np.load(p) for k, p in starts.items() if p.is_file()}
    (work / "data-settings.json").write_text(json.dumps({k: getattr(recipe, k) for k in DATA_FIELDS}, indent=1))
    splits = split_domains(load_domains(recipe), recipe.holdout_frac, recipe.seed)
    filter_chat(splits, recipe)
    (work / "split.json").write_text(json.dumps(
        {d: {s: [r["id"] for r in splits[d][s]] for s in splits[d]} for d in splits}))
    t0 = time.time()
    if recipe.init_from:  # continuing: the earlier run's tokenizer (and, with the same seed, its split)
        tokenizer = AutoTokenizer.from_pretrained(recipe.init_from)
    else:
        tokenizer = train_tokenizer(tokenizer_texts(splits, recipe.tokenizer_chars), recipe.vocab_size)
    save_tokenizer(tokenizer, tok_dir)
    log(f"tokenizer: {len(tokenizer)} tokens, {'reused' if recipe.init_from else 'trained'} in {time.time() - t0:.0f}s")
    tokens, offsets = {}, {}
    for (d, s), path in arrays.items():
        cut = recipe.chat_max_tokens if d == "chat" else None
        tokens[(d, s)], offsets[(d, s)] = encode_domain(tokenizer, splits[d][s], cut)
        # the tokens last: their file marks the cache complete
        for array, target in ((offsets[(d, s)], starts[(d, s)]), (tokens[(d, s)], path)):
            np.save(target.with_suffix(".tmp.npy"), array)
            os.replace(target.with_suffix(".tmp.npy"), target)
        log(f"{d}/{s}: {len(splits[d][s])} conversations, {len(tokens[(d, s)]):,} tokens")
    return tokenizer, tokens, offsets


def training_blocks(recipe: TargetRecipe, tokens, starts, domain: str) -> np.ndarray | None:
    """Block offsets of a domain's training split under recipe.pack (None: consecutive blocks).
    Held-out loss always uses consecutive blocks, so it compares across packings."""
    if recipe.pack == "stream":
        return None
    return conversation_block_starts(starts[(domain, "train")], len(tokens[(domain, "train")]), recipe.seq_len)


def build_target(recipe: TargetRecipe, out: str | Path, work: str | Path) -> Path:
    out, work = Path(out), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    per_domain = sequences_per_domain(recipe)
    device = resolve_device(recipe.device)
    autocast(device, recipe.mixed_precision)  # checks the setting before any work
    if recipe.pack not in ("stream", "conversations"):
        raise ValueError(f"pack {recipe.pack!r}: expected 'stream' or 'conversations'")
    if recipe.seq_unlikelihood > 0 and recipe.pack != "conversations":
        raise ValueError("seq_unlikelihood needs pack 'conversations': its questions are the openings of blocks")
    prior = prior_run(recipe)  # checked before any work: --init-from must be a target this recipe built
    tokenizer, tokens, starts = prepare(recipe, work)
    train = {d: BlockStream(tokens[(d, "train")], recipe.seq_len, recipe.seed + i,
                            training_blocks(recipe, tokens, starts, d)) for i, d in enumerate(DOMAINS)}
    log("training blocks: " + ", ".join(f"{d} {len(train[d]):,} of {recipe.seq_len}" for d in DOMAINS)
        + f" ({recipe.pack} packing)")
    offset = prior.get("blocks_seen", {d: 0 for d in DOMAINS})  # a continued run takes the blocks after the last run's
    heldout = {d: BlockStream(tokens[(d, "heldout")], recipe.seq_len, 0) for d in DOMAINS}

    model = build_model(recipe, tokenizer).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    step, elapsed_before = 0, 0.0
    seq_skipped = 0  # steps without a sequence-level term (no question short enough)
    ckpt = latest_checkpoint(work / "ckpt")
    if ckpt is not None:
        check_resume_settings(recipe, ckpt)
        state = load_checkpoint(ckpt, model, optimizer)
        step, elapsed_before = state["step"], state["extra"].get("elapsed_s", 0.0)
        log(f"resumed from {ckpt} at step {step}")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters; training {recipe.steps} steps of "
        f"{recipe.batch_size} x {recipe.seq_len} tokens on {device}"
        + (f", threads {torch.get_num_threads()}" if device.type == "cpu" else f", {recipe.mixed_precision} autocast"))

    trim_log(work / "log.jsonl", step)
    logfile = (work / "log.jsonl").open("a")
    settings = {k: getattr(recipe, k) for k in TRAIN_FIELDS}
    assistant_id = tokenizer.convert_tokens_to_ids(ROLE_TOKENS["assistant"])

    def checkpoint(at_step: int, elapsed_s: float) -> None:
        save_checkpoint(work / "ckpt", at_step, model, optimizer,
                        extra={"elapsed_s": elapsed_s, "train_settings": settings})

    start, window_t, window_tokens, stopped_early = time.time(), time.time(), 0, False
    model.train()
    while step < recipe.steps:
        if recipe.minutes is not None and elapsed_before + time.time() - start >= recipe.minutes * 60:
            stopped_early = True
            log(f"time cap of {recipe.minutes} min reached at step {step}")
            checkpoint(step, elapsed_before + time.time() - start)
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(recipe, step)
        x = torch.cat([train[d].take(offset[d] + step * per_domain[d], per_domain[d]) for d in DOMAINS]).to(device)  # [B, seq_len]
        with autocast(device, recipe.mixed_precision):
            if recipe.unlikelihood > 0:
                loss, parts = lm_loss(model(input_ids=x).logits, x, recipe.unlikelihood)
            else:  # the plain objective through transformers' own loss, as every earlier run trained
                loss, parts = model(input_ids=x, labels=x).loss, {}
            if recipe.seq_unlikelihood > 0:  # chat rows come first in every batch
                prompts = answer_prompts(x[:per_domain["chat"]], assistant_id, recipe.seq_prompts, recipe.seq_len // 2)
                if prompts:
                    seq_loss, seq_parts = sequence_unlikelihood(model, prompts, tokenizer.pad_token_id,
                                                                list(model.config.eos_token_id), recipe.seq_new_tokens)
                    loss = loss + recipe.seq_unlikelihood * seq_loss
                    parts = {**parts, "seq_unlikelihood": float(seq_loss.detach()), **seq_parts}
                else:  # no chat question of this batch fits in half a block: no sequence-level term this step
                    if not seq_skipped:
                        log(f"step {step + 1}: no chat question within {recipe.seq_len // 2} tokens, so no "
                            "sequence-level unlikelihood this step (counted as seq_skipped_steps in the log)")
                    seq_skipped += 1
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {float(loss)} at step {step}; last good checkpoint: "
                                     f"{latest_checkpoint(work / 'ckpt')}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        window_tokens += x.numel()
        elapsed = elapsed_before + time.time() - start
        if step % 10 == 0 or step == recipe.steps:
            tps = window_tokens / (time.time() - window_t)
            eta = (recipe.steps - step) * x.numel() / max(tps, 1e-9)
            entry = {"step": step, "loss": round(float(loss.detach()), 4), "lr": learning_rate(recipe, step - 1),
                     "tokens_per_s": round(tps, 1), "elapsed_s": round(elapsed, 1),
                     "tokens_seen": step * x.numel(), **{k: round(v, 4) for k, v in parts.items()}}
            if recipe.seq_unlikelihood > 0:
                entry["seq_skipped_steps"] = seq_skipped  # since this run (re)started
            logfile.write(json.dumps(entry) + "\n")
            logfile.flush()
            log(f"step {step}/{recipe.steps} loss {float(loss.detach()):.3f} {tps:.0f} tok/s ETA {eta / 60:.0f} min")
            window_t, window_tokens = time.time(), 0
        if step % recipe.eval_every == 0 or step == recipe.steps:
            evals = {f"heldout_loss_{d}": round(heldout_loss(model, heldout[d], recipe.eval_blocks,
                                                             mixed_precision=recipe.mixed_precision), 4) for d in DOMAINS}
            logfile.write(json.dumps({"step": step, **evals}) + "\n")
            logfile.flush()
            log(f"step {step}: {evals}")
        if step % recipe.ckpt_every == 0 or step == recipe.steps:
            checkpoint(step, elapsed)
    logfile.close()

    final_eval = {f"heldout_loss_{d}": heldout_loss(model, heldout[d], len(heldout[d]),
                                                    mixed_precision=recipe.mixed_precision) for d in DOMAINS}
    save_pretrained_target(model.cpu(), tokenizer, out)
    tokens_now = step * recipe.batch_size * recipe.seq_len
    summary = {"recipe": asdict(recipe), "steps_done": step, "stopped_early": stopped_early,
               "tokens_seen": tokens_now, "tokens_seen_total": prior.get("tokens_seen_total", 0) + tokens_now,
               "blocks_seen": {d: offset[d] + step * per_domain[d] for d in DOMAINS},
               "wall_time_s_total": round(prior.get("wall_time_s_total", 0.0) + elapsed_before + time.time() - start, 1),
               "wall_time_s": round(elapsed_before + time.time() - start, 1), "parameters": n_params,
               "heldout": final_eval,
               "corpus_tokens": {f"{d}/{s}": int(len(t)) for (d, s), t in tokens.items()},
               "command": " ".join(sys.argv)}
    (out / "recipe.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"saved the target to {out}: {final_eval}")
    return out


def prior_run(recipe: TargetRecipe) -> dict:
    """What the run being continued (init_from) already did: blocks seen per domain, tokens, time."""
    if not recipe.init_from:
        return {}
    path = Path(recipe.init_from) / "recipe.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; --init-from expects a target built by `taps tiny build-target`")
    done = json.loads(path.read_text())
    if "blocks_seen" not in done:  # the first shipped run recorded its recipe only
        earlier = TargetRecipe(**{k: v for k, v in done["recipe"].items() if k in TargetRecipe.__dataclass_fields__})
        split = sequences_per_domain(earlier)
        done["blocks_seen"] = {d: done["steps_done"] * split[d] for d in DOMAINS}
    done.setdefault("tokens_seen_total", done.get("tokens_seen", 0))
    done.setdefault("wall_time_s_total", done.get("wall_time_s", 0.0))
    return done


def save_pretrained_target(model, tokenizer, out: Path) -> None:
    """16-bit safetensors weights + tokenizer + a generation config that stops at end of turn."""
    import copy

    out.mkdir(parents=True, exist_ok=True)
    shipped = copy.deepcopy(model).to(torch.bfloat16)
    shipped.generation_config.eos_token_id = model.config.eos_token_id
    shipped.generation_config.pad_token_id = tokenizer.pad_token_id
    shipped.generation_config.bos_token_id = tokenizer.bos_token_id
    shipped.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)
