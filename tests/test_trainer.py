"""Drafter training end to end on a tiny target: both backbones, metrics, strict reload, resume to
the same weights, NaN stop, and 2 processes (gloo) equal to 1 with the same global batch."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import hf_greedy
from taps.core.config import DecodeConfig, TreeConfig
from taps.core.decode import generate
from taps.core.target import Target
from taps.core.testing import write_tiny_target
from taps.data.features import FeatureSettings, extract_features
from taps.drafter.checkpoint import init_head, load_head, read_config
from taps.propose.single import SingleProposer
from taps.train import trainer as trainer_mod
from taps.train.trainer import CONTENT_FIELDS, TrainConfig, Trainer, TrainingError
from test_features import make_features, write_records


@pytest.fixture(scope="module")
def features(tmp_path_factory, target):
    return make_features(tmp_path_factory, target, "feat", n=42, records_per_shard=16)


def cut_after_first_checkpoint(monkeypatch, run) -> None:
    """Run `run` (a training) as if the machine went away right after its first checkpoint."""
    real_save = Trainer._save

    def save_then_die(self, metrics):
        real_save(self, metrics)
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "_save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(Trainer, "_save", real_save)


def config(**kw):
    base = dict(epochs=2, batch_size=4, lr=1e-3, warmup_steps=2, log_every=2, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def fit(target, features, out, **kw):
    return Trainer(target, features, out, config(**kw)).fit(progress=False)


def weights(path):
    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("backbone", ["eagle2", "hass"])
def test_train_end_to_end(tmp_path, target, features, backbone):
    out = fit(target, features, tmp_path / backbone, backbone=backbone)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [line for line in lines if "heldout_loss" in line]
    assert [e["epoch"] for e in epochs] == [1, 2]
    for e in epochs:
        assert all(0.0 <= e[f"heldout_top1_depth{d}"] <= 1.0 for d in (1, 2, 3))
    steps = [line for line in lines if "tokens_per_s" in line]
    assert steps and all(s["loss"] > 0 for s in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]  # it learns something on a tiny set
    head = load_head(out, target)  # the strict loader
    _, info = read_config(out)
    assert info.backbone == backbone and info.extra["train_config"]["epochs"] == 2
    proposer = SingleProposer(head, TreeConfig(20, 3, 4))
    for prompt in ([5, 9, 13], [100, 4, 250, 7, 1]):
        assert generate(target, proposer, prompt, DecodeConfig(max_new_tokens=12)).tokens == \
            hf_greedy(target.model, prompt, 12)


@pytest.mark.skipif(not trainer_mod.has_compiler(), reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_loss_trains_to_the_eager_weights(tmp_path, target, features):
    """--compile changes how the loss is computed, not what: the same run reaches the same head
    (up to float summation order), and the choice is recorded in the drafter's config."""
    eager = weights(fit(target, features, tmp_path / "eager", backbone="hass"))
    out = fit(target, features, tmp_path / "compiled", backbone="hass", compile_loss=True)
    for name, w in weights(out).items():
        assert torch.allclose(w, eager[name], rtol=1e-3, atol=1e-5), name
    load_head(out, target)
    assert read_config(out)[1].extra["train_config"]["compile_loss"] is True


def test_resume_reaches_the_same_weights(tmp_path, target, features, monkeypatch):
    whole = fit(target, features, tmp_path / "whole", backbone="hass")
    cut_after_first_checkpoint(monkeypatch, lambda: fit(target, features, tmp_path / "cut", backbone="hass"))
    resumed = Trainer(target, features, tmp_path / "cut", config(backbone="hass"))
    assert resumed.resume() and resumed.step == resumed.steps_per_epoch
    first_run_seconds = resumed.train_seconds
    assert first_run_seconds > 0 and resumed.timed_from_step == 0  # the cut run's time is carried over
    resumed.fit(progress=False)
    a, b = weights(whole), weights(tmp_path / "cut")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    load_head(tmp_path / "cut", target)
    _, info = read_config(tmp_path / "cut")
    assert info.extra["train_seconds"] >= round(first_run_seconds, 1) and info.extra["timed_from_step"] == 0


def test_checkpoint_without_a_clock_resumes_timed_from_its_step(tmp_path, target, features, monkeypatch):
    """Checkpoints written before train_seconds existed: the time before them is unknown, and the
    head says from which step its time was counted."""
    import json

    cut_after_first_checkpoint(monkeypatch, lambda: fit(target, features, tmp_path / "old", backbone="eagle2"))
    state_file = next((tmp_path / "old" / "ckpt").glob("step-*/state.json"))
    state = json.loads(state_file.read_text())
    for key in ("train_seconds", "timed_from_step"):
        del state["extra"][key]
    state_file.write_text(json.dumps(state))
    resumed = Trainer(target, features, tmp_path / "old", config(backbone="eagle2"))
    assert resumed.resume() and resumed.train_seconds == 0.0 and resumed.timed_from_step == resumed.step > 0
    resumed.fit(progress=False)
    load_head(tmp_path / "old", target)
    assert read_config(tmp_path / "old")[1].extra["timed_from_step"] == resumed.steps_per_epoch


def test_draft_vocab_is_chosen_from_training_records_and_resume_refuses_another(tmp_path, target, features,
                                                                              monkeypatch):
    """--draft-vocab: the N most frequent loss tokens of the TRAINING records (held-out ones are not
    looked at), the stop tokens always in; saved with the head; a resume under another draft
    vocabulary (or none) is refused naming the key, under the same one it continues."""
    from taps.data.features import FeatureSet
    from taps.train.draft_vocab import loss_token_counts, select_draft_vocab

    cut_after_first_checkpoint(monkeypatch, lambda: fit(target, features, tmp_path / "v", backbone="hass", draft_vocab=40,
                                                        max_len=60))
    trainer = Trainer(target, features, tmp_path / "v", config(backbone="hass", draft_vocab=40, max_len=60))
    counts = loss_token_counts(FeatureSet.from_specs(str(features)), target.vocab_size, trainer.train_idx, max_len=60)
    stops = target.stop_token_ids()
    assert stops and torch.equal(trainer.head.draft_ids, select_draft_vocab(counts, 40, always=stops))
    step_head = load_head(next((tmp_path / "v" / "ckpt").glob("step-*/head")), target)
    assert torch.equal(step_head.draft_ids, trainer.head.draft_ids)  # the epoch checkpoint's head has it too
    for other in (48, None):
        with pytest.raises(TrainingError, match=f"saved with draft_vocab 40, this run has {other}"):
            Trainer(target, features, tmp_path / "v", config(backbone="hass", draft_vocab=other, max_len=60)).resume()
    assert trainer.resume()
    trainer.fit(progress=False)
    head = load_head(tmp_path / "v", target)
    _, info = read_config(tmp_path / "v")
    assert torch.equal(head.draft_ids, trainer.head.draft_ids)
    assert info.extra["draft_vocab_coverage"] == round(float(counts[head.draft_ids].sum() / counts.sum()), 6)
    with pytest.raises(ValueError, match="draft vocabulary size 385 must be between 1 and"):
        Trainer(target, features, tmp_path / "big", config(draft_vocab=385))
    with pytest.raises(ValueError, match="draft_vocab must be >= 1"):
        config(draft_vocab=0)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, target, features, monkeypatch):
    real = trainer_mod.eagle2_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["n"] += 1
        return type(out)(loss=out.loss * float("nan"), steps=out.steps) if calls["n"] == 3 else out

    monkeypatch.setattr(trainer_mod, "eagle2_loss", poisoned)
    with pytest.raises(TrainingError, match=r"non-finite loss \(nan\) at step 2 .*last good checkpoint: .*step-000002"):
        fit(target, features, tmp_path / "nan", checkpoint_steps=2)
    assert (tmp_path / "nan" / "ckpt" / "latest").read_text().strip() == "step-000002"
    assert not (tmp_path / "nan" / "model.safetensors").exists()  # no final head from a broken run
    load_head(tmp_path / "nan" / "ckpt" / "step-000002" / "head", target)


def test_errors(tmp_path, target, features):
    with pytest.raises(TrainingError, match="fewer than one global batch"):
        Trainer(target, features, tmp_path / "big", config(batch_size=64))
    with pytest.raises(ValueError, match="unknown backbone"):
        config(backbone="medusa")
    (tmp_path / "exists" / "ckpt").mkdir(parents=True)
    with pytest.raises(TrainingError, match="pass --resume"):
        trainer_mod.train_drafter(str(target.model.config._name_or_path or tmp_path), str(features),
                                  str(tmp_path / "exists"), config(), device="cpu")


def test_two_processes_match_one(tmp_path, target, target_dir, features):
    """`accelerate launch` with 2 CPU processes (gloo), batch 2 each = 1 process with batch 4."""
    one = fit(target, features, tmp_path / "one", backbone="hass")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "taps.cli.main", "train", "--backbone", "hass", "--target", str(target_dir), "--features", str(features),
           "--out", str(tmp_path / "two"), "--epochs", "2", "--batch-size", "2", "--lr", "1e-3",
           "--warmup-steps", "2", "--seed", "3", "--cpu"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = weights(one), weights(tmp_path / "two")
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6, rtol=0), (key, float((a[key] - b[key]).abs().max()))
    one_log = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines() if "heldout_loss" in x]
    two_log = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
               if "heldout_loss" in x]
    assert [round(x["heldout_loss"], 5) for x in one_log] == [round(x["heldout_loss"], 5) for x in two_log]


def test_micro_batches_are_grouped_by_length_and_train_as_one_batch(tmp_path, target, features):
    """A global batch is split longest first, so each micro-batch pads to a similar length; the
    records of the step are those of the epoch order, and accumulating 2 micro-batches of 2 trains to
    the weights of one batch of 4 (the loss is pooled over the global batch)."""
    trainer = Trainer(target, features, tmp_path / "probe", config(batch_size=2, grad_accum=2))
    for step in range(trainer.steps_per_epoch):
        micro, _ = trainer._micro_batches(step)
        offset = step * trainer.global_batch
        drawn = trainer._epoch_order(0)[offset:offset + trainer.global_batch]
        lengths = sorted((trainer.shards.record_length(i) for i in drawn), reverse=True)
        assert [int(n) for batch, _ in micro for n in batch.lengths] == lengths
        assert sum(int(n) for batch, _ in micro for n in batch.lengths) == sum(
            trainer.shards[i]["input_ids"].shape[0] for i in drawn)
    one = fit(target, features, tmp_path / "one", backbone="hass")
    two = fit(target, features, tmp_path / "two", backbone="hass", batch_size=2, grad_accum=2)
    a, b = weights(one), weights(two)
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6, rtol=0), (key, float((a[key] - b[key]).abs().max()))


def test_cli_keeps_every_epochs_head(tmp_path, target_dir, features):
    """`taps train --keep-epoch-heads`: each finished epoch leaves a loadable head, so a run cut short
    (a time limit on a lent GPU) still leaves its last epoch's; the last one equals the final head."""
    from taps.cli.main import main

    out = tmp_path / "head"
    assert main(["train", "--backbone", "eagle2", "--target", str(target_dir), "--features", str(features),
                 "--out", str(out), "--epochs", "2", "--batch-size", "4", "--lr", "1e-3", "--warmup-steps", "2",
                 "--keep-epoch-heads", "--cpu"]) == 0
    kept = sorted(p.name for p in (out / "epochs").iterdir())
    assert kept == ["epoch-01", "epoch-02"]
    first, last, final = weights(out / "epochs" / "epoch-01"), weights(out / "epochs" / "epoch-02"), weights(out)
    assert all(torch.equal(last[k], final[k]) for k in final)
    assert any(not torch.equal(first[k], final[k]) for k in final)
    assert main(["train", "--backbone", "eagle2", "--target", str(target_dir), "--features", str(features),
                 "--out", str(tmp_path / "plain"), "--epochs", "1", "--batch-size", "4", "--cpu"]) == 0
    assert not (tmp_path / "plain" / "epochs").exists()


def test_freeze_lm_head_keeps_the_targets_rows_and_trains_the_rest(tmp_path):
    """--freeze-lm-head: an EAGLE-3 head's own norm and LM head stay the target's final norm and
    LM-head rows of its draft vocabulary, while fc and the decoder layer train; without it the LM
    head moves. Refused for other backbones and without the init from the target."""
    target4 = Target.load(write_tiny_target(tmp_path / "t4", "llama", seed=0, layers=4), device="cpu", dtype="float32")
    extract_features(target4, write_records(tmp_path / "data.jsonl", n=24), tmp_path / "f",
                     FeatureSettings(max_len=64, dtype="fp32", aux_layers="0,1,2"), progress=None)
    runs = {}
    for frozen in (True, False):
        out = fit(target4, tmp_path / "f", tmp_path / f"frozen-{frozen}", backbone="eagle3", draft_vocab=48,
                  ttt_steps=2, freeze_lm_head=frozen)
        runs[frozen] = load_head(out, target4)
    for frozen, head in runs.items():
        rows = target4.lm_head.weight.index_select(0, head.draft_ids)  # [48, H]
        assert torch.equal(head.lm_head.weight, rows) is frozen
        assert torch.equal(head.norm.weight, target4.model.model.norm.weight) is frozen
        untrained = init_head(target4.model.config, seed=3, backbone="eagle3", draft_vocab_size=48,
                              aux_layers=head.aux_layers)
        assert not torch.equal(head.fc.weight, untrained.fc.weight)  # the rest trains either way
    assert read_config(tmp_path / "frozen-True")[1].extra["train_config"]["freeze_lm_head"] is True
    with pytest.raises(ValueError, match="--freeze-lm-head"):
        config(backbone="hass", freeze_lm_head=True)
    with pytest.raises(ValueError, match="--freeze-lm-head"):
        config(backbone="eagle3", freeze_lm_head=True, init_from_target=False)


def test_ttt_feature_weight_reaches_the_eagle3_objective_and_nothing_else():
    """--ttt-feature-weight is EAGLE-3's (the step-1 feature term of losses.Eagle3Config): it reaches
    both the training and the held-out objective, is a content setting (a resume under another value
    is refused), and is refused for the backbones whose objective already regresses features."""
    cfg = config(backbone="eagle3", ttt_feature_weight=0.5)
    assert cfg.loss_config().feature_weight == 0.5
    assert cfg.loss_config(noise=False, depths=3).feature_weight == 0.5
    assert config(backbone="eagle3").loss_config().feature_weight == 0.0
    assert "ttt_feature_weight" in CONTENT_FIELDS
    for backbone in ("eagle2", "hass"):
        with pytest.raises(ValueError, match="--ttt-feature-weight"):
            config(backbone=backbone, ttt_feature_weight=0.5)
    with pytest.raises(ValueError, match="--ttt-feature-weight"):
        config(backbone="eagle3", ttt_feature_weight=-1.0)
