"""The model card's acceptance table: every shipped drafter on the first n GSM8K-test and n
MT-Bench (first turn) questions, at temperatures 0 and 1, with the pooled acceptance length
(new tokens / verifier calls, SPEC §5) of each cell. A small stand-in for the study harness of
issue 6, kept here so the embedded default documents itself."""

from __future__ import annotations

import json
from pathlib import Path

from taps.config import DecodeConfig, SamplingConfig, TreeConfig
from taps.decode import chat_ids, generate
from taps.drafter.checkpoint import load_head
from taps.propose.single import SingleProposer
from taps.target import Target
from taps.tiny.target_check import first_rows

BENCHES = ("gsm8k", "mt_bench")


def bench_prompts(data_dir: str | Path, n: int) -> dict[str, list[str]]:
    data_dir = Path(data_dir)
    return {"gsm8k": [r["question"] for r in first_rows(data_dir / "gsm8k" / "test.jsonl", n)],
            "mt_bench": [r["turns"][0] for r in first_rows(data_dir / "mt_bench" / "question.jsonl", n)]}


def acceptance_table(target: Target, drafters: dict[str, Path], data_dir: str | Path, n: int = 20,
                     temperatures: tuple[float, ...] = (0.0, 1.0), max_new_tokens: int = 256,
                     tree: TreeConfig = TreeConfig(), seed: int = 0) -> dict:
    """{drafter: {bench: {temperature: {"tau", "new_tokens", "verifier_calls"}}}}"""
    prompts = {b: [chat_ids(target.tokenizer, [{"role": "user", "content": q}]) for q in qs]
               for b, qs in bench_prompts(data_dir, n).items()}
    stops = target.stop_token_ids()
    table: dict = {}
    for name, path in drafters.items():
        proposer = SingleProposer(load_head(path, target)[0], tree)
        for bench, ids_list in prompts.items():
            for temp in temperatures:
                new = calls = 0
                for i, ids in enumerate(ids_list):
                    cfg = DecodeConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(temp),
                                       stop_token_ids=stops, seed=seed + i)
                    result = generate(target, proposer, ids, cfg)
                    new, calls = new + len(result.tokens), calls + result.verifier_calls
                table.setdefault(name, {}).setdefault(bench, {})[str(temp)] = {
                    "tau": new / calls, "new_tokens": new, "verifier_calls": calls}
    return table


def to_markdown(table: dict, temperatures: tuple[float, ...] = (0.0, 1.0)) -> str:
    cols = [(b, str(t)) for t in temperatures for b in BENCHES]
    head = "| drafter | " + " | ".join(f"{b} T={t}" for b, t in cols) + " |"
    rows = [head, "| --- |" + " --- |" * len(cols)]
    for name in sorted(table):
        rows.append(f"| {name} | " + " | ".join(f"{table[name][b][t]['tau']:.2f}" for b, t in cols) + " |")
    return "\n".join(rows) + "\n"


def write_table(table: dict, out: str | Path, temperatures=(0.0, 1.0)) -> None:
    out = Path(out)
    out.with_suffix(".json").write_text(json.dumps(table, indent=2) + "\n")
    out.with_suffix(".md").write_text(to_markdown(table, temperatures))
