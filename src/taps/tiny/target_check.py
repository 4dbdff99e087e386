"""Is the tiny target a real model of both domains? Two checks for the model card:

- math: greedy answers to GSM8K test questions follow GSM8K's solution format (at least one
  `<<...>>` calculator annotation and a final `#### <number>` line); the final number's accuracy
  is reported too, for information;
- chat: answers to MT-Bench first turns are not a repeated phrase: the share of distinct word
  4-grams among all word 4-grams of each answer (1.0 = no 4-gram repeats); and, as a crude sign of
  being on topic, the share of the question's content words (not instruction words such as
  "write" or "please") that the answer uses, beside the same share for the *other* questions
  (what an answer that ignores its question scores by chance): an on-topic answer uses more of its
  own question's words than of the others'.

The chat measures are taken twice: with greedy decoding, and under MT-Bench's own generation
protocol, which samples each category at its own temperature (FastChat's `temperature_config`:
writing and roleplay 0.7, STEM and humanities 0.1, the rest greedy); a small model that loops
under greedy decoding may still answer on topic when sampled, as MT-Bench samples it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from taps.config import DecodeConfig, SamplingConfig
from taps.decode import chat_ids, generate
from taps.target import Target

FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")
ANNOTATION = re.compile(r"<<[^<>]*=[^<>]*>>")


def follows_gsm8k_format(answer: str) -> bool:
    return bool(ANNOTATION.search(answer)) and bool(FINAL.search(answer.strip()))


def final_number(answer: str) -> str | None:
    match = FINAL.search(answer.strip())
    return match.group(1).replace(",", "") if match else None


def distinct_4gram_share(text: str) -> float:
    words = text.split()
    grams = [tuple(words[i:i + 4]) for i in range(len(words) - 3)]
    return len(set(grams)) / len(grams) if grams else 0.0


WORD = re.compile(r"[a-z]+")
# Words that say what to do, not what about: an answer that only echoes these is not on topic.
NOT_TOPIC = frozenset("""
a about above after again all also an and any are as ask at be been before being below between both but by
can could did do does doing down during each few for from further had has have having he her here hers him his
how i if in into is it its itself just me more most my no nor not now of off on once only or other our out over
own please same she should so some such than that the their them then there these they this those through to too
under until up very was we were what when where which while who whom why will with would you your yours yourself
answer answers compose craft describe develop draft explain following give help imagine include including keep
let make pretend provide short sure tell use using write writing words word paragraph paragraphs sentence
sentences role question questions request first start begin
""".split())


def topic_words(text: str) -> set[str]:
    return {w for w in WORD.findall(text.lower()) if len(w) >= 3 and w not in NOT_TOPIC}


def question_word_recall(question: str, answer: str) -> float:
    """Share of the question's content words that occur in the answer (0 when it has none)."""
    wanted = topic_words(question)
    return len(wanted & topic_words(answer)) / len(wanted) if wanted else 0.0


def first_rows(path: Path, n: int) -> list[dict]:
    """The first n JSON objects of a JSONL file."""
    rows = []
    with path.open() as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if len(rows) == n:
                break
    return rows


# FastChat's MT-Bench answer generation (gen_model_answer.py, temperature_config): per category.
MT_BENCH_TEMPERATURE = {"writing": 0.7, "roleplay": 0.7, "extraction": 0.0, "math": 0.0, "coding": 0.0,
                        "reasoning": 0.0, "stem": 0.1, "humanities": 0.1}


@dataclass
class ChatMeasures:
    """Repetition and on-topic measures of answers to n questions."""

    distinct_4gram_mean: float
    distinct_4gram_min: float
    question_word_recall: float  # mean share of the answer's own question's content words it uses
    question_word_recall_chance: float  # the same share for the other questions (ignoring the question scores this)
    uses_question_words: float  # share of answers that use at least one word of their question
    on_topic_share: float  # share of answers using more of their own question's words than of the others' (mean)
    mean_answer_tokens: float


def chat_measures(questions: list[str], answers: list[str], lengths: list[int]) -> ChatMeasures:
    n = len(questions)
    shares = [distinct_4gram_share(a) for a in answers]
    own = [question_word_recall(q, a) for q, a in zip(questions, answers)]
    other = [sum(question_word_recall(questions[j], a) for j in range(n) if j != i) / max(1, n - 1)
             for i, a in enumerate(answers)]
    return ChatMeasures(
        distinct_4gram_mean=sum(shares) / n, distinct_4gram_min=min(shares),
        question_word_recall=sum(own) / n, question_word_recall_chance=sum(other) / n,
        uses_question_words=sum(r > 0 for r in own) / n,
        on_topic_share=sum(o > c for o, c in zip(own, other)) / n, mean_answer_tokens=sum(lengths) / n)


@dataclass
class TargetCheck:
    gsm8k_questions: int
    gsm8k_format_share: float
    gsm8k_accuracy: float
    mean_answer_tokens_gsm8k: float
    mt_bench_questions: int
    mt_bench_greedy: ChatMeasures
    mt_bench_sampled: ChatMeasures  # MT-Bench's per-category temperatures, seed = question index


def _answer(target: Target, question: str, max_new_tokens: int, temperature: float = 0.0,
            seed: int = 0) -> tuple[str, int]:
    tok = target.tokenizer
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, stop_token_ids=target.stop_token_ids(),
                       sampling=SamplingConfig(temperature=temperature), seed=seed)
    result = generate(target, None, chat_ids(tok, [{"role": "user", "content": question}]), cfg)
    stop = set(cfg.stop_token_ids)
    return tok.decode([t for t in result.tokens if t not in stop], skip_special_tokens=True), len(result.tokens)


def mt_bench_temperature(row: dict) -> float:
    category = row.get("category")
    if category not in MT_BENCH_TEMPERATURE:
        raise ValueError(f"MT-Bench question {row.get('question_id')}: category {category!r}, expected one of "
                         f"{sorted(MT_BENCH_TEMPERATURE)}")
    return MT_BENCH_TEMPERATURE[category]


def check_target(target: Target, data_dir: str | Path, n: int = 20, max_new_tokens: int = 256,
                 samples: list | None = None) -> TargetCheck:
    """Greedy answers to the first n GSM8K-test questions; greedy and MT-Bench-protocol answers
    to the first n MT-Bench questions (first turn)."""
    data_dir = Path(data_dir)
    gsm = first_rows(data_dir / "gsm8k" / "test.jsonl", n)
    mt = first_rows(data_dir / "mt_bench" / "question.jsonl", n)
    temperatures = [mt_bench_temperature(row) for row in mt]  # checked before any decoding
    fmt, correct, gsm_len = 0, 0, 0
    for row in gsm:
        answer, length = _answer(target, row["question"], max_new_tokens)
        fmt += follows_gsm8k_format(answer)
        correct += final_number(answer) == final_number(row["answer"])
        gsm_len += length
        if samples is not None:
            samples.append({"bench": "gsm8k", "question": row["question"], "answer": answer})
    questions = [row["turns"][0] for row in mt]
    measures = {}
    for mode in ("greedy", "sampled"):
        answers, lengths = [], []
        for i, (question, temp) in enumerate(zip(questions, temperatures)):
            answer, length = _answer(target, question, max_new_tokens, temp if mode == "sampled" else 0.0, seed=i)
            answers.append(answer)
            lengths.append(length)
            if samples is not None:
                samples.append({"bench": "mt_bench", "decoding": mode if mode == "greedy" else f"T={temp}",
                                "question": question, "answer": answer})
        measures[mode] = chat_measures(questions, answers, lengths)
    return TargetCheck(
        gsm8k_questions=len(gsm), gsm8k_format_share=fmt / len(gsm), gsm8k_accuracy=correct / len(gsm),
        mean_answer_tokens_gsm8k=gsm_len / len(gsm), mt_bench_questions=len(mt),
        mt_bench_greedy=measures["greedy"], mt_bench_sampled=measures["sampled"])


def as_dict(check: TargetCheck) -> dict:
    return asdict(check)
