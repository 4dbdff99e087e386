"""Resumable training state: a run interrupted and resumed ends at the same weights."""

import pytest
import torch

from taps.train.state import latest_checkpoint, load_checkpoint, save_checkpoint


def make(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_steps(model, opt, steps):
    for _ in range(steps):
        x = torch.randn(16, 4)  # draws from the global RNG: resume must restore it
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_resume_reaches_the_same_weights(tmp_path):
    model, opt = make()
    train_steps(model, opt, 6)
    straight = {k: v.clone() for k, v in model.state_dict().items()}

    model, opt = make()
    train_steps(model, opt, 3)
    save_checkpoint(tmp_path, 3, model, opt, extra={"elapsed_s": 1.5})
    train_steps(model, opt, 1)  # work after the checkpoint is lost by the "crash"
    model, opt = make(seed=99)
    state = load_checkpoint(latest_checkpoint(tmp_path), model, opt)
    assert state["step"] == 3 and state["extra"] == {"elapsed_s": 1.5}
    train_steps(model, opt, 3)
    for key, value in model.state_dict().items():
        assert torch.equal(value, straight[key]), key


def test_keeps_newest_and_ignores_partial(tmp_path):
    model, opt = make()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, opt, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003"]
    (tmp_path / "step-000004.tmp").mkdir()  # an interrupted write
    assert latest_checkpoint(tmp_path).name == "step-000003"
    assert latest_checkpoint(tmp_path / "none") is None
    (tmp_path / "latest").write_text("step-000009\n")
    with pytest.raises(FileNotFoundError, match="step-000009"):
        latest_checkpoint(tmp_path)
