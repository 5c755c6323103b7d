"""The framework callbacks never end the trainer's run: tied weights (a tiny GPT-2 under the
Hugging Face Trainer, a Lightning module with a tied head), Lightning's BackboneFinetuning,
manual optimization with two optimizers, a module that never calls its own forward, and the
fault-injection suite through ``trainer.fit`` and ``trainer.train``."""

from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

import neuraldbg  # noqa: E402
from neuraldbg import NeuralDbgWarning  # noqa: E402
from neuraldbg.lightning import NeuralDbgCallback as LightningCallback  # noqa: E402
from neuraldbg.testing import fault_at  # noqa: E402
from neuraldbg.transformers import NeuralDbgCallback as HFCallback  # noqa: E402

FAULT_STEP = 6


def fit(module, tmp_path, callbacks, data, **trainer_args):
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        callbacks=callbacks,
        logger=L.loggers.CSVLogger(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
        **trainer_args,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    return trainer


def regression(n: int = 192, seed: int = 0, nan_batch: int = -1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x.sum(1, keepdim=True) * 0.3
    if nan_batch >= 0:
        x[nan_batch * 16 : (nan_batch + 1) * 16] = float("nan")
    return torch.utils.data.TensorDataset(x, y)


def tokens(n: int = 96, vocab: int = 64, length: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randint(0, vocab, (n, length), generator=g))


def layer_norm(module: nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in module.parameters(recurse=False)))


# ------------------------------------------------------------------------------ Lightning


class TiedHead(L.LightningModule):
    """A tiny language model whose head shares the embedding's weight; ``training_step`` calls
    its submodules, never ``self``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight
        self.truth = []

    def training_step(self, batch, batch_idx):
        (t,) = batch
        logits = self.head(torch.tanh(self.mix(self.emb(t))))
        return nn.functional.cross_entropy(logits.reshape(-1, 64), t.reshape(-1))

    def on_before_optimizer_step(self, optimizer):
        self.truth.append(layer_norm(self.emb))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_lightning_with_a_tied_head(tmp_path):
    module = TiedHead()
    cb = LightningCallback(verbose=False)
    trainer = fit(module, tmp_path, [cb], tokens(), max_steps=10)
    dbg = cb.dbg
    assert trainer.global_step == 10 and dbg.step == 10
    steps, emb = dbg.history("emb")
    assert list(steps) == list(range(10))
    np.testing.assert_allclose(emb, module.truth, rtol=1e-5)
    np.testing.assert_array_equal(dbg.history("head")[1], emb)
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as f:
        header = f.readline()
    assert "neuraldbg/grad_norm/emb" in header and "neuraldbg/grad_norm/head" not in header


class Backbone(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.truth = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def on_before_optimizer_step(self, optimizer):
        first = self.backbone[0]
        self.truth.append(layer_norm(first) if first.weight.grad is not None else None)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)


def test_lightning_backbone_finetuning_observes_the_backbone_once_unfrozen(tmp_path):
    from lightning.pytorch.callbacks import BackboneFinetuning

    module = Backbone()
    cb = LightningCallback(verbose=False)
    tune = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5, verbose=False)
    trainer = fit(module, tmp_path, [tune, cb], regression(64), max_epochs=3)  # 4 steps an epoch
    dbg = cb.dbg
    assert trainer.global_step == 12 and dbg.step == 12
    steps, values = dbg.history("backbone.0")
    seen = [s for s, v in zip(steps, values) if v >= 0]
    expected = [s for s, t in enumerate(module.truth) if t is not None]
    assert expected[0] == 4 and seen == expected, (seen, expected)
    np.testing.assert_allclose(values[values >= 0], [t for t in module.truth if t is not None], rtol=1e-5)
    assert not [h for h in dbg.explain_failure() if h.confidence >= 0.5]


class TwoOptimizers(L.LightningModule):
    """Manual optimization: two optimizers, each stepped once per training_step (after one
    backward pass, or each after its own)."""

    def __init__(self, backwards: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.backwards = backwards
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        loss = nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        if self.backwards == 2:
            loss = nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)
            opt_b.zero_grad()
            self.manual_backward(loss)
        opt_b.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.05), torch.optim.SGD(self.b.parameters(), lr=0.05)


@pytest.mark.parametrize("backwards", [1, 2])
def test_lightning_manual_optimization_with_two_optimizers_counts_like_global_step(tmp_path, backwards):
    cb = LightningCallback(verbose=False)
    trainer = fit(TwoOptimizers(backwards), tmp_path, [cb], regression(160), max_epochs=1)
    assert trainer.global_step == 20
    assert cb.dbg.step == trainer.global_step


class SubmoduleCaller(L.LightningModule):
    """``training_step`` calls ``self.net(x)``: the LightningModule's own forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_nan_batch_is_read_where_it_enters_a_watched_module(tmp_path):
    cb = LightningCallback(verbose=False)
    trainer = fit(SubmoduleCaller(), tmp_path, [cb], regression(25 * 16, nan_batch=20), max_steps=25)
    dbg = cb.dbg
    assert dbg.step == trainer.global_step
    top = dbg.explain_failure()[0]
    assert (top.failure, top.cause, top.step) == ("data_anomaly", "bad_input_data", 20), top
    for h in dbg.explain_failure():
        assert "inputs were finite" not in h.description


# ------------------------------------------------------------------------------ Hugging Face


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as every GPT-2 is
    return model


class TokenRows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = tokens()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        (t,) = self.data[i]
        return {"input_ids": t, "labels": t}


class Spy(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def hf_train(tmp_path, model, callbacks, max_steps: int = 12):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=max_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenRows(), callbacks=callbacks)
    trainer.train()
    return trainer


def test_hf_trainer_on_a_tied_gpt2_logs_and_finishes(tmp_path):
    spy = Spy()
    cb = HFCallback(halt_on=True, verbose=False)
    trainer = hf_train(tmp_path, tiny_gpt2(), [spy, cb])
    dbg = cb.dbg
    assert trainer.state.global_step == 12 and dbg.step == 12
    logged = [r for r in spy.logs if "neuraldbg/failures" in r]
    assert len(logged) >= 6
    final = spy.logs[-1]
    assert "neuraldbg/grad_norm/transformer.wte" in final and "neuraldbg/grad_norm/lm_head" not in final
    wte = dbg.history("transformer.wte")[1]
    np.testing.assert_array_equal(dbg.history("lm_head")[1], wte)
    assert final["neuraldbg/grad_norm/transformer.wte"] == pytest.approx(float(wte[-1]))


# ------------------------------------------------------------------- the fault-injection suite


class Regressor(L.LightningModule):
    """Calls ``self(x)``: every entry point of a plain step is reached."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class FaultAt(L.Callback):
    """Makes ``entry`` raise from the training step ``FAULT_STEP`` on."""

    def __init__(self, entry: str) -> None:
        self.entry = entry
        self.stack = contextlib.ExitStack()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == FAULT_STEP:
            self.stack.enter_context(fault_at(self.entry))


LIGHTNING_ENTRIES = [
    "forward_pre",
    "forward_post",
    "backward_start",
    "backward_done",
    "optimizer_step",
    "callback",
    "log_metrics",
    "exit",
]


@pytest.mark.parametrize("entry", LIGHTNING_ENTRIES)
def test_a_fault_in_a_lightning_fit_leaves_training_as_it_was(tmp_path, entry):
    plain = Regressor()
    fit(plain, tmp_path / "plain", [], regression(), max_steps=12)
    module = Regressor()
    cb = LightningCallback(verbose=False)
    fault = FaultAt(entry)
    with fault.stack, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NeuralDbgWarning)
        trainer = fit(module, tmp_path / "run", [fault, cb], regression(), max_steps=12)
    said = [str(w.message) for w in caught if "internal error" in str(w.message)]
    assert len(said) == 1 and f"internal error in {entry}" in said[0], said
    assert trainer.global_step == 12
    for a, b in zip(plain.parameters(), module.parameters()):
        assert torch.equal(a, b)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in module.modules())
    run = neuraldbg.load(tmp_path / "run" / "lightning_logs" / "version_0" / "neuraldbg.ndbg")
    steps, _ = run.history("net.0")
    # (The callback's own methods, the exit and the logging run at the end of training.)
    assert len(steps) >= (12 if entry in ("exit", "callback", "log_metrics") else FAULT_STEP - 1)
    assert isinstance(run.explain_failure(), list)


class HFRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x, labels=None):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = regression(128)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return {"x": x, "labels": y}


class HFFaultAt(transformers.TrainerCallback):
    def __init__(self, entry: str) -> None:
        self.entry = entry
        self.stack = contextlib.ExitStack()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == FAULT_STEP:
            self.stack.enter_context(fault_at(self.entry))


@pytest.mark.parametrize("entry", ["callback", "log_metrics", "optimizer_step", "forward_pre"])
def test_a_fault_in_an_hf_train_leaves_training_as_it_was(tmp_path, entry):
    def train(model, callbacks, out):
        args = transformers.TrainingArguments(
            output_dir=str(out),
            max_steps=12,
            per_device_train_batch_size=8,
            learning_rate=1e-2,
            logging_steps=2,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
        )
        transformers.Trainer(model=model, args=args, train_dataset=Rows(), callbacks=callbacks).train()

    plain = HFRegressor()
    train(plain, [], tmp_path / "plain")
    model = HFRegressor()
    fault = HFFaultAt(entry)
    cb = HFCallback(verbose=False)
    with fault.stack, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NeuralDbgWarning)
        train(model, [fault, cb], tmp_path / "run")
    said = [str(w.message) for w in caught if "internal error" in str(w.message)]
    assert len(said) == 1 and f"internal error in {entry}" in said[0], said
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)
    steps, _ = neuraldbg.load(tmp_path / "run" / "neuraldbg.ndbg").history("fc1")
    # (Metrics are logged every 2 steps: that fault fires at the first log after the step.)
    assert FAULT_STEP - 1 <= len(steps) <= FAULT_STEP + 2
