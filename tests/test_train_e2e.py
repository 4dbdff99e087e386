"""End to end on a tiny random target and a small synthetic corpus with strong regularities:
regenerate the answers with the target, extract features, train both backbones; the trained
heads' greedy acceptance length on held-out prompts is clearly above an untrained head's."""

import json
import random

import pytest

from taps.cli.main import main
from taps.core.config import DecodeConfig, TreeConfig
from taps.data.features import FeatureSettings, extract_features
from taps.data.regenerate import RegenerateSettings, regenerate
from taps.core.decode import chat_ids, generate
from taps.drafter.checkpoint import init_head, load_head, read_config
from taps.propose.single import SingleProposer
from taps.core.target import Target
from taps.train.trainer import TrainConfig, Trainer

WORDS = "alpha beta gamma delta one two three four red blue green".split()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, target_dir):
    root = tmp_path_factory.mktemp("e2e")
    target = Target.load(target_dir, device="cpu", dtype="float32")
    rng = random.Random(0)

    def record(i):
        k = rng.randrange(len(WORDS))
        prompt = " ".join(WORDS[(k + j) % len(WORDS)] for j in range(6))  # cyclic word runs
        return {"id": f"p{i}", "source": "synthetic", "conversations": [{"role": "user", "content": prompt},
                                                                         {"role": "assistant", "content": "-"}]}
    records = [record(i) for i in range(120)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:100]))
    regenerate(target, root / "train.jsonl", root / "regen.jsonl", RegenerateSettings(max_new_tokens=24), progress=None)
    extract_features(target, root / "regen.jsonl", root / "feat", FeatureSettings(max_len=96, dtype="fp32"),
                     progress=None)
    return root, target, records[100:]


def mean_acceptance(target, head, held_out):
    cfg = DecodeConfig(max_new_tokens=24, stop_token_ids=target.stop_token_ids())
    taus = [generate(target, SingleProposer(head, TreeConfig(20, 4, 4)),
                     chat_ids(target.tokenizer, r["conversations"][:1]), cfg).acceptance_length for r in held_out]
    return sum(taus) / len(taus)


@pytest.mark.parametrize("backbone", ["eagle2", "hass"])
def test_trained_head_beats_untrained(setup, backbone):
    root, target, held_out = setup
    cfg = TrainConfig(backbone=backbone, epochs=8, batch_size=8, lr=3e-3, warmup_steps=5, log_every=50, seed=0)
    Trainer(target, root / "feat", root / backbone, cfg).fit(progress=False)
    trained = load_head(root / backbone, target)
    untrained = init_head(target.model.config, seed=0).bind(target.embed_tokens, target.lm_head)
    tau_untrained, tau_trained = mean_acceptance(target, untrained, held_out), mean_acceptance(target, trained, held_out)
    print(f"{backbone}: acceptance length untrained {tau_untrained:.2f}, trained {tau_trained:.2f}")
    assert tau_untrained < 1.2
    assert tau_trained > tau_untrained + 0.3


def test_trained_head_works_with_taps_generate(setup, target_dir, capsys):
    root, _, held_out = setup
    head_dir = root / "eagle2" if (root / "eagle2" / "model.safetensors").exists() else None
    if head_dir is None:
        cfg = TrainConfig(backbone="eagle2", epochs=2, batch_size=8, lr=3e-3, warmup_steps=5, seed=0)
        Trainer(Target.load(target_dir, device="cpu", dtype="float32"), root / "feat", root / "g", cfg).fit(progress=False)
        head_dir = root / "g"
    prompt = held_out[0]["conversations"][0]["content"]
    args = ["generate", "--target", str(target_dir), "--prompt", prompt, "--max-new-tokens", "16", "--device", "cpu",
            "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--drafter", str(head_dir)]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["acceptance_length"] > 1.0


def test_draft_vocab_training_end_to_end(setup, target_dir):
    """`taps train --draft-vocab 16`: the head drafts over the 16 most frequent training tokens (the
    target's stop tokens among them), its checkpoint carries the mapping and the coverage, it
    decodes exactly the plain greedy output and its drafts are accepted like a full head's."""
    root, target, held_out = setup
    out = root / "hass-v16"
    args = ["train", "--backbone", "hass", "--target", str(target_dir), "--features", str(root / "feat"),
            "--out", str(out), "--epochs", "8", "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "5",
            "--seed", "0", "--draft-vocab", "16", "--cpu"]
    assert main(args) == 0
    head = load_head(out, target)  # strict: draft_vocab_size, d2t and t2d agree
    _, info = read_config(out)
    assert head.draft_ids.numel() == 16 and set(target.stop_token_ids()) <= set(head.draft_ids.tolist())
    assert info.extra["train_config"]["draft_vocab"] == 16
    assert 0.5 < info.extra["draft_vocab_coverage"] < 1.0  # 30 distinct tokens are trained on
    cfg = DecodeConfig(max_new_tokens=24, stop_token_ids=target.stop_token_ids())
    for record in held_out[:6]:
        prompt = chat_ids(target.tokenizer, record["conversations"][:1])
        spec = generate(target, SingleProposer(head, TreeConfig(20, 4, 4)), prompt, cfg)
        assert spec.tokens == generate(target, None, prompt, cfg).tokens
    tau = mean_acceptance(target, head, held_out)
    print(f"hass, draft vocabulary 16 (coverage {info.extra['draft_vocab_coverage']:.3f}): acceptance length {tau:.2f}")
    assert tau > 1.3  # an untrained head scores < 1.2 (test_trained_head_beats_untrained)


def test_eagle3_trains_end_to_end_through_the_cli(tmp_path, capsys):
    """`taps features --aux-layers auto` then `taps train --backbone eagle3` on an 8-layer tiny target
    (three distinct default layers): the head loads strictly, decodes exactly the plain greedy
    output, and its drafts are accepted far more than an untrained EAGLE-3 head's."""
    from taps.core.testing import write_tiny_target

    target_dir = write_tiny_target(tmp_path / "t8", "llama", seed=0, layers=8)
    target = Target.load(target_dir, device="cpu", dtype="float32")
    rng = random.Random(1)

    def record(i):
        k = rng.randrange(len(WORDS))
        prompt = " ".join(WORDS[(k + j) % len(WORDS)] for j in range(6))
        return {"id": f"p{i}", "source": "synthetic", "conversations": [{"role": "user", "content": prompt},
                                                                         {"role": "assistant", "content": "-"}]}
    records = [record(i) for i in range(100)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:80]))
    regenerate(target, tmp_path / "train.jsonl", tmp_path / "regen.jsonl", RegenerateSettings(max_new_tokens=24),
               progress=None)
    base = ["--target", str(target_dir), "--device", "cpu"]
    assert main(["features", *base, "--data", str(tmp_path / "regen.jsonl"), "--out", str(tmp_path / "feat"),
                 "--max-len", "96", "--dtype", "fp32", "--aux-layers", "auto"]) == 0
    out = tmp_path / "e3"
    assert main(["train", "--backbone", "eagle3", "--target", str(target_dir), "--features", str(tmp_path / "feat"),
                 "--out", str(out), "--epochs", "8", "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "5",
                 "--seed", "0", "--draft-vocab", "64", "--ttt-steps", "3", "--cpu"]) == 0
    capsys.readouterr()
    head = load_head(out, target)
    _, info = read_config(out)
    assert info.backbone == "eagle3" and head.aux_layers == (1, 3, 4) and head.draft_ids.numel() == 64
    held_out = records[80:]
    cfg = DecodeConfig(max_new_tokens=24, stop_token_ids=target.stop_token_ids())
    for rec in held_out[:6]:
        prompt = chat_ids(target.tokenizer, rec["conversations"][:1])
        assert generate(target, SingleProposer(head, TreeConfig(20, 4, 4)), prompt, cfg).tokens == \
            generate(target, None, prompt, cfg).tokens
    untrained = init_head(target.model.config, seed=0, backbone="eagle3").attach(target)
    tau_untrained, tau = mean_acceptance(target, untrained, held_out), mean_acceptance(target, head, held_out)
    print(f"eagle3: acceptance length untrained {tau_untrained:.2f}, trained {tau:.2f}")
    assert tau_untrained < 1.2
    assert tau > tau_untrained + 0.3
    # a features directory without aux layers cannot train an EAGLE-3 head: one line, exit 2
    assert main(["features", *base, "--data", str(tmp_path / "regen.jsonl"), "--out", str(tmp_path / "plain"),
                 "--max-len", "96", "--dtype", "fp32"]) == 0
    capsys.readouterr()
    assert main(["train", "--backbone", "eagle3", "--target", str(target_dir), "--features", str(tmp_path / "plain"),
                 "--out", str(tmp_path / "bad"), "--epochs", "1", "--cpu"]) == 2
    assert "--aux-layers auto" in capsys.readouterr().err
