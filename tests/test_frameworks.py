"""The Lightning and Hugging Face callbacks on tiny models, with the real packages: the step
count equals the framework's global_step (accumulation is one step), gradients are the ones the
backward produced (before the framework clips them), a planted failure is diagnosed (and halts
training with ``halt_on``), a healthy run raises no alarm, and the trace, report and verdict land
where the framework keeps its run."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.nn as nn

L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

from neuraldbg.lightning import NeuralDbgCallback as LightningCallback  # noqa: E402
from neuraldbg.transformers import NeuralDbgCallback as HFCallback  # noqa: E402


def regression_data(n: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


def layer_norm(module: nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in module.parameters(recurse=False)))


class Regressor(L.LightningModule):
    """training_step calls ``self.net``: the LightningModule itself is never called."""

    def __init__(self, lr: float = 0.01, jump_at: int = -1, jump_to: float = 100.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        self.lr, self.jump_at, self.jump_to = lr, jump_at, jump_to
        self.pre_clip = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        # Lightning calls this after accumulation and before gradient_clip_val clips.
        self.pre_clip.append({n: layer_norm(self.net[int(n.split(".")[1])]) for n in ("net.0", "net.2", "net.4")})

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        jump = self.jump_at

        def factor(step: int) -> float:
            return self.jump_to / self.lr if 0 <= jump <= step else 1.0

        return [opt], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, factor), "interval": "step"}]


def fit(module, tmp_path, callback, batch_size: int = 32, **trainer_args):
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        callbacks=[callback],
        logger=L.loggers.CSVLogger(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
        **trainer_args,
    )
    loader = torch.utils.data.DataLoader(regression_data(), batch_size=batch_size)
    trainer.fit(module, loader)
    return trainer


def test_lightning_healthy_run_with_clipping_and_accumulation(tmp_path, capsys):
    module = Regressor()
    cb = LightningCallback()
    trainer = fit(module, tmp_path, cb, max_steps=12, gradient_clip_val=1e-3, accumulate_grad_batches=2)
    dbg = cb.dbg
    assert trainer.global_step == 12 and dbg.step == trainer.global_step
    steps, values = dbg.history("net.0")
    assert list(steps) == list(range(12))
    truth = [n["net.0"] for n in module.pre_clip]
    assert min(truth) > 1e-2, "clipping at 1e-3 bit on every step"
    np.testing.assert_allclose(values, truth, rtol=1e-4)
    assert not [h for h in dbg.explain_failure() if h.confidence >= 0.5]
    log_dir = trainer.log_dir
    assert os.path.getsize(os.path.join(log_dir, "neuraldbg.ndbg")) > 0
    assert os.path.getsize(os.path.join(log_dir, "neuraldbg.html")) > 1000
    with open(os.path.join(log_dir, "metrics.csv")) as f:
        header = f.readline()
    assert "neuraldbg/failures" in header and "neuraldbg/grad_norm/net.0" in header
    assert "no failure detected" in capsys.readouterr().out
    assert all(not m._forward_hooks for m in module.modules()), "hooks removed"


def test_lightning_explosion_under_clipping_is_diagnosed_and_halts(tmp_path, capsys):
    module = Regressor(jump_at=10, jump_to=1000.0)
    cb = LightningCallback(halt_on="exploding_gradients")
    # Full batches: the explosion is the same on every step, not batch noise around 1e3.
    trainer = fit(module, tmp_path, cb, batch_size=256, max_steps=60, gradient_clip_val=1.0)
    dbg = cb.dbg
    assert dbg.step == trainer.global_step
    assert trainer.global_step < 60, "halted once the explosion was confirmed"
    onset = next(s for s, norms in enumerate(module.pre_clip) if max(norms.values()) > 1e3)
    h = dbg.explain_failure("exploding_gradients")[0]
    assert h.confidence >= 0.5 and h.step == onset
    assert module.pre_clip[onset][h.layer] > 1e3
    assert "clipping" in h.description
    assert dbg.halted and dbg.halted[0].failure == "exploding_gradients"
    assert "exploding_gradients" in capsys.readouterr().out


class NanAfter(nn.Module):
    """Identity for its first ``at`` calls, then produces NaN in its own computation."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.calls, self.at = 0, at

    def forward(self, x):
        self.calls += 1
        return x * float("nan") if 0 <= self.at < self.calls else x


class HFRegressor(nn.Module):
    def __init__(self, nan_after: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.Tanh()
        self.bad = NanAfter(nan_after)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x, labels=None):
        out = self.fc2(self.bad(self.act(self.fc1(x))))
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = regression_data(128)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return {"x": x, "labels": y}


class LogSpy(transformers.TrainerCallback):
    """Stands for a ``report_to`` integration: records what each log event carries."""

    def __init__(self) -> None:
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def hf_train(tmp_path, model, cb, max_steps: int, spy=None, **args):
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=max_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        **args,
    )
    callbacks = [cb] if spy is None else [spy, cb]  # the spy first, as the integrations are
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=Rows(), callbacks=callbacks)
    trainer.train()
    return trainer


def test_hf_trainer_warmup_longer_than_the_run_is_named(tmp_path):
    # warmup_steps=1000 on a run of 80 steps (counted in samples, or copied from a longer run):
    # the rate rises from 0 all run long and never reaches the 1e-3 asked for.
    cb = HFCallback()
    trainer = hf_train(tmp_path, HFRegressor(), cb, max_steps=80, warmup_steps=1000)
    lrs = [r["learning_rate"] for r in trainer.state.log_history if "learning_rate" in r]
    assert lrs == sorted(lrs) and lrs[-1] < 1e-4, "the Trainer's own schedule: rising, far below 1e-3"
    top = cb.dbg.explain_failure()[0]
    assert top.confidence >= 0.5 and top.cause == "learning_rate_too_low", top
    assert "was still rising at the end: a warmup far longer than the run" in " ".join(top.description.split())
    assert top.remedies[0].startswith("shorten the learning-rate warmup"), top.remedies


def test_hf_trainer_healthy_run_with_accumulation_and_max_grad_norm(tmp_path, capsys):
    cb, spy = HFCallback(), LogSpy()
    trainer = hf_train(
        tmp_path, HFRegressor(), cb, max_steps=8, spy=spy, gradient_accumulation_steps=2, max_grad_norm=1e-3
    )
    dbg = cb.dbg
    assert trainer.state.global_step == 8 and dbg.step == 8
    steps, values = dbg.history("fc1")
    assert list(steps) == list(range(8)) and (values > 1e-3).all(), "read before max_grad_norm clipped"
    assert not [h for h in dbg.explain_failure() if h.confidence >= 0.5]
    assert os.path.getsize(tmp_path / "neuraldbg.ndbg") > 0
    assert os.path.getsize(tmp_path / "neuraldbg.html") > 1000
    logged = [r for r in spy.logs if "neuraldbg/failures" in r]
    assert len(logged) == len(spy.logs) >= 4 and logged[-1]["neuraldbg/failures"] == 0.0
    assert "neuraldbg/grad_norm/fc1" in spy.logs[-1], "the per-layer summary with the final metrics"
    assert "no failure detected" in capsys.readouterr().out


def test_hf_trainer_nan_is_located_and_halts_training(tmp_path):
    cb = HFCallback(halt_on="non_finite")
    trainer = hf_train(tmp_path, HFRegressor(nan_after=5), cb, max_steps=40)
    dbg = cb.dbg
    assert dbg.step == trainer.state.global_step < 40
    h = dbg.explain_failure("non_finite")[0]
    assert h.step == 5 and h.layer == "bad"
    assert dbg.halted


def test_accelerate_loop_with_accumulation_and_clipping():
    accelerate = pytest.importorskip("accelerate")
    from neuraldbg import NeuralDbg

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = HFRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(regression_data(64), batch_size=8)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    truth = []
    with NeuralDbg(model) as dbg:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = model(x, labels=y)["loss"]
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    truth.append(layer_norm(model.fc1))
                    accelerator.clip_grad_norm_(model.parameters(), 1e-4)
                opt.step()
                opt.zero_grad()
    assert dbg.step == len(truth) == 4
    steps, values = dbg.history("fc1")
    assert list(steps) == [0, 1, 2, 3]
    assert min(truth) > 1e-3, "clipping at 1e-4 bit"
    np.testing.assert_allclose(values, truth, rtol=1e-4)


@pytest.mark.parametrize("zero", [True, False])
def test_lightning_callback_watches_every_rank_and_only_rank_zero_writes_the_report(tmp_path, zero):
    """In a distributed job every rank must watch (the per-step exchange needs them all, and a
    halt must stop them all): a rank other than 0 observes its steps too, writes no report and
    logs nothing. (The events Lightning calls, with a stand-in trainer of that rank.)"""
    from types import SimpleNamespace

    class Logger:
        def __init__(self) -> None:
            self.logged: list = []

        def log_metrics(self, numbers, step):  # type: ignore[no-untyped-def]
            self.logged.append(numbers)

        def log_hyperparams(self, params):  # type: ignore[no-untyped-def]
            self.logged.append(params)

        def save(self) -> None:
            pass

    logger = Logger()
    trainer = SimpleNamespace(
        is_global_zero=zero,
        log_dir=str(tmp_path),
        default_root_dir=str(tmp_path),
        should_stop=False,
        loggers=[logger],
        global_step=3,
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cb = LightningCallback(verbose=False)
    cb.on_train_start(trainer, model)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
    cb.on_train_end(trainer, model)
    assert cb.dbg is not None and cb.dbg.step == 3
    assert (tmp_path / "neuraldbg.html").exists() == zero
    assert bool(logger.logged) == zero
