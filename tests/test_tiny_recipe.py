"""The tiny-target recipe end to end at a toy size (seconds), so it cannot rot: corpus, tokenizer
with chat template, training with checkpoints, resume to the same weights, 16-bit save."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from taps.data.chat import encode_conversation
from taps.target import Target
from taps.tiny import target_recipe
from taps.tiny.target_recipe import TargetRecipe, build_target
from taps.tiny.tokenizer import END_OF_TURN


def toy(data_dir, **kw):
    base = dict(data_dir=str(data_dir), chat_source=f"sharegpt:{data_dir / 'sharegpt.json'}", vocab_size=300,
                hidden_size=32, layers=1, heads=2, kv_heads=2, intermediate_size=64, max_positions=256, seq_len=32,
                batch_size=4, steps=6, warmup=2, eval_every=3, ckpt_every=3, eval_blocks=4, holdout_frac=0.1,
                tokenizer_chars=100_000)
    base.update(kw)
    return TargetRecipe(**base)


def test_recipe_end_to_end(tmp_path, data_dir):
    out = build_target(toy(data_dir), tmp_path / "out", tmp_path / "work")
    summary = json.loads((out / "recipe.json").read_text())
    assert summary["steps_done"] == 6 and not summary["stopped_early"]
    assert summary["tokens_seen"] == 6 * 4 * 32
    assert set(summary["heldout"]) == {"heldout_loss_chat", "heldout_loss_math"}
    log = [json.loads(x) for x in (tmp_path / "work" / "log.jsonl").read_text().splitlines()]
    assert any("heldout_loss_math" in x for x in log) and any("tokens_per_s" in x for x in log)
    # 16-bit weights, loadable by Target and by plain transformers
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "model.safetensors").values())
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)
    target = Target.load(out, device="cpu", dtype="float32")
    tok = target.tokenizer
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    assert tok.convert_tokens_to_ids(END_OF_TURN) in target.stop_token_ids()
    # the chat template round-trips a two-turn conversation with the right assistant mask
    convo = [{"role": "user", "content": "Tom has 2 apples."}, {"role": "assistant", "content": "He has 2."},
             {"role": "user", "content": "And now?"}, {"role": "assistant", "content": "Still 2."}]
    ids, mask = encode_conversation(tok, convo)
    assert tok.decode(ids) == tok.apply_chat_template(convo, tokenize=False)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == f"He has 2.{END_OF_TURN}Still 2.{END_OF_TURN}"


def test_resume_reaches_the_same_weights(tmp_path, data_dir, monkeypatch):
    whole = build_target(toy(data_dir), tmp_path / "whole", tmp_path / "whole.work")
    real = target_recipe.save_checkpoint

    def save_then_die(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(target_recipe, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        build_target(toy(data_dir), tmp_path / "cut", tmp_path / "cut.work")
    monkeypatch.setattr(target_recipe, "save_checkpoint", real)
    build_target(toy(data_dir), tmp_path / "cut", tmp_path / "cut.work")
    a, b = load_file(whole / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # the log of the interrupted run reads like the whole run's: nothing past the checkpoint repeats
    steps = {name: [json.loads(x)["step"] for x in (tmp_path / f"{name}.work" / "log.jsonl").read_text().splitlines()]
             for name in ("whole", "cut")}
    assert steps["cut"] == steps["whole"]


def test_a_resume_with_other_training_settings_is_refused(tmp_path, data_dir):
    work = tmp_path / "work"
    work.mkdir()
    (work / "log.jsonl").write_text(json.dumps({"step": 5, "loss": 9.0}) + "\n")  # a stretch that never checkpointed
    build_target(toy(data_dir, steps=3), tmp_path / "out", work)
    assert [json.loads(x) for x in (work / "log.jsonl").read_text().splitlines()][0]["step"] == 3
    with pytest.raises(ValueError, match="step-000003: this checkpoint was trained with batch_size = 4, this run has 8"):
        build_target(toy(data_dir, steps=6, batch_size=8), tmp_path / "out2", work)
    with pytest.raises(ValueError, match="trained with pack = 'stream', this run has 'conversations'"):
        build_target(toy(data_dir, steps=6, pack="conversations"), tmp_path / "out2", work)
    with pytest.raises(ValueError, match="step-000003: this checkpoint is at step 3, past this run's --steps 2"):
        build_target(toy(data_dir, steps=2), tmp_path / "out2", work)
    build_target(toy(data_dir, steps=6, minutes=60.0), tmp_path / "out2", work)  # more steps, a cap: resumes
    assert json.loads((tmp_path / "out2" / "recipe.json").read_text())["steps_done"] == 6


def test_time_cap_stops_early_and_says_so(tmp_path, data_dir):
    out = build_target(toy(data_dir, minutes=0.0), tmp_path / "out", tmp_path / "work")
    summary = json.loads((out / "recipe.json").read_text())
    assert summary["stopped_early"] and summary["steps_done"] == 0


def test_target_recipe_device_and_mixed_precision(tmp_path, data_dir):
    out = build_target(toy(data_dir, device="auto", mixed_precision="bf16", steps=3), tmp_path / "out", tmp_path / "work")
    done = json.loads((out / "recipe.json").read_text())
    assert done["steps_done"] == 3 and all(0 < v < 20 for v in done["heldout"].values())
    assert Target.load(out, device="cpu", dtype="float32").model.dtype == torch.float32  # loads like any target
    with pytest.raises(ValueError, match="mixed_precision 'fp8'"):
        build_target(toy(data_dir, mixed_precision="fp8"), tmp_path / "o2", tmp_path / "w2")
    assert not (tmp_path / "w2" / "tokenizer").exists()  # refused before any work


def test_domain_split_of_each_batch():
    from taps.tiny.target_recipe import sequences_per_domain

    assert sequences_per_domain(TargetRecipe(batch_size=8)) == {"chat": 4, "math": 4}
    assert sequences_per_domain(TargetRecipe(batch_size=5, math_share=0.6)) == {"chat": 2, "math": 3}
    with pytest.raises(ValueError, match="leaves a domain without sequences"):
        sequences_per_domain(TargetRecipe(batch_size=2, math_share=0.9))


def test_continue_training_from_a_built_target(tmp_path, data_dir):
    from transformers import AutoTokenizer

    from taps.target import tokenizer_fingerprint

    first = build_target(toy(data_dir), tmp_path / "v0", tmp_path / "v0.work")
    second = build_target(toy(data_dir, init_from=str(first), steps=4), tmp_path / "v1", tmp_path / "v1.work")
    done = json.loads((second / "recipe.json").read_text())
    assert done["steps_done"] == 4 and done["tokens_seen_total"] == (6 + 4) * 4 * 32
    assert done["blocks_seen"] == {"chat": 2 * 10, "math": 2 * 10}  # continues after the 6 x 2 blocks of v0
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(first)) == \
        tokenizer_fingerprint(AutoTokenizer.from_pretrained(second))
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert set(a) == set(b) and any(not torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(FileNotFoundError, match="recipe.json: missing"):
        build_target(toy(data_dir, init_from=str(tmp_path)), tmp_path / "v2", tmp_path / "v2.work")


def test_chat_filters_keep_the_split_and_drop_long_or_code_answers():
    from taps.tiny.target_recipe import filter_chat, keep_chat

    def conv(cid, answer):
        return {"id": cid, "conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]}

    assert keep_chat(conv("a", "one two three"), 3, True)
    assert not keep_chat(conv("a", "one two three four"), 3, False)  # an answer over the word cap
    assert not keep_chat(conv("a", "see ```x = 1```"), None, True)  # a code fence
    assert keep_chat(conv("a", "see ```x = 1```"), None, False)
    splits = {"chat": {"train": [conv("t1", "short"), conv("t2", "```code```")], "heldout": [conv("h1", "fine")]},
              "math": {"train": [], "heldout": []}}
    filter_chat(splits, TargetRecipe(chat_drop_code=True))
    assert [r["id"] for r in splits["chat"]["train"]] == ["t1"] and [r["id"] for r in splits["chat"]["heldout"]] == ["h1"]
    with pytest.raises(ValueError, match="chat/train: no conversation passes"):
        filter_chat(splits, TargetRecipe(chat_max_answer_words=0))


def test_a_rerun_with_other_data_settings_is_refused(tmp_path, data_dir):
    build_target(toy(data_dir, steps=2), tmp_path / "out", tmp_path / "work")
    with pytest.raises(ValueError, match="made with chat_drop_code = False, this run has True"):
        build_target(toy(data_dir, steps=2, chat_drop_code=True), tmp_path / "out2", tmp_path / "work")
    build_target(toy(data_dir, steps=3), tmp_path / "out3", tmp_path / "work")  # same data, more steps: resumes


def test_conversation_blocks_start_at_conversations_and_do_not_overlap():
    from taps.tiny.target_recipe import BlockStream, conversation_block_starts

    lengths = [5, 3, 12, 4, 4, 2, 9]
    starts = np.cumsum([0] + lengths[:-1])
    tokens = np.concatenate([np.full(n, i, dtype=np.int32) for i, n in enumerate(lengths)])  # token = conversation id
    blocks = conversation_block_starts(starts, len(tokens), seq_len=6)
    assert set(blocks.tolist()) <= set(starts.tolist())
    assert np.all(np.diff(blocks) >= 6) and blocks[-1] + 6 <= len(tokens)
    assert blocks.tolist() == [0, 8, 20, 28]  # conv 0 + 1 of conv 1; conv 2 (12) cut; conv 3 + 2 of 4; conv 5 + 4 of 6
    stream = BlockStream(tokens, 6, seed=0, block_starts=blocks)
    assert [row[0] for row in stream.blocks.tolist()] == [0, 2, 3, 5]  # every block opens a conversation


def test_conversation_packing_trains_and_needs_the_starts_cache(tmp_path, data_dir):
    work = tmp_path / "work"
    out = build_target(toy(data_dir, pack="conversations"), tmp_path / "out", work)
    assert json.loads((out / "recipe.json").read_text())["recipe"]["pack"] == "conversations"
    bos = Target.load(out, device="cpu", dtype="float32").tokenizer.bos_token_id
    tokens, starts = np.load(work / "tokens-chat-train.npy"), np.load(work / "starts-chat-train.npy")
    assert all(tokens[s] == bos for s in starts)  # each recorded start is a conversation's <|bos|>
    (work / "starts-chat-train.npy").unlink()  # a work dir from before conversation packing
    with pytest.raises(ValueError, match="starts-chat-train.npy: missing"):
        build_target(toy(data_dir, pack="conversations", steps=8), tmp_path / "out2", work)
    with pytest.raises(ValueError, match="pack 'rows'"):
        build_target(toy(data_dir, pack="rows"), tmp_path / "out3", tmp_path / "work3")


def test_unlikelihood_trains_and_is_logged(tmp_path, data_dir):
    work = tmp_path / "work"
    out = build_target(toy(data_dir, steps=10, unlikelihood=1.0), tmp_path / "out", work)
    assert json.loads((out / "recipe.json").read_text())["recipe"]["unlikelihood"] == 1.0
    entry = next(json.loads(x) for x in (work / "log.jsonl").read_text().splitlines() if "tokens_per_s" in x)
    assert entry["unlikelihood"] > 0 and entry["loss"] > entry["ce"]
    with pytest.raises(ValueError, match="unlikelihood = 1.0, this run has 0.0"):
        build_target(toy(data_dir, steps=12), tmp_path / "out", work)


def test_sequence_unlikelihood_fine_tuning_runs_and_is_logged(tmp_path, data_dir):
    base = build_target(toy(data_dir, steps=4), tmp_path / "base", tmp_path / "base.work")
    with pytest.raises(ValueError, match="seq_unlikelihood needs pack 'conversations'"):
        build_target(toy(data_dir, init_from=str(base), seq_unlikelihood=1.0), tmp_path / "out", tmp_path / "work")
    out = build_target(toy(data_dir, steps=10, init_from=str(base), pack="conversations", seq_len=64,
                           seq_unlikelihood=1.0, seq_prompts=2, seq_new_tokens=8), tmp_path / "out", tmp_path / "work")
    assert json.loads((out / "recipe.json").read_text())["recipe"]["seq_unlikelihood"] == 1.0
    entry = next(json.loads(x) for x in (tmp_path / "work" / "log.jsonl").read_text().splitlines()
                 if "tokens_per_s" in x)
    assert "seq_unlikelihood" in entry and 0.0 <= entry["seq_repeat_share"] <= 1.0
    assert 0 <= entry["seq_skipped_steps"] < entry["step"]
    # blocks of 8 tokens leave room for no question (4 tokens at most): every step is counted as skipped
    build_target(toy(data_dir, steps=10, init_from=str(base), pack="conversations", seq_len=8, seq_unlikelihood=1.0,
                     seq_prompts=2, seq_new_tokens=4), tmp_path / "out8", tmp_path / "work8")
    entry = next(json.loads(x) for x in (tmp_path / "work8" / "log.jsonl").read_text().splitlines()
                 if "tokens_per_s" in x)
    assert entry["seq_skipped_steps"] == entry["step"] == 10 and "seq_unlikelihood" not in entry

