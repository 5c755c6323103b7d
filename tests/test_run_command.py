"""``neuraldbg run``: real training scripts, written to a temporary folder, run unchanged through
the command (``python -m neuraldbg run``, what the installed ``neuraldbg`` script calls).

Ground truth is what each script printed itself (its argv, its losses, its step count, the
framework's ``global_step``), never what the engine said.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

import neuraldbg

PYTHON_DIR = str(Path(neuraldbg.__file__).resolve().parent.parent)


def _env() -> Dict[str, str]:
    path = os.pathsep.join(p for p in (PYTHON_DIR, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def run(tmp: Path, script: str, *words: str, name: str = "train.py", timeout: int = 240) -> subprocess.CompletedProcess:
    path = tmp / name
    path.write_text(textwrap.dedent(script))
    words_list = list(words)
    split = words_list.index("SCRIPT") if "SCRIPT" in words_list else len(words_list)
    cmd = [sys.executable, "-m", "neuraldbg", "run", *words_list[:split], str(path), *words_list[split + 1 :]]
    return subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=timeout)


def losses(stdout: str) -> List[Tuple[int, float]]:
    return [(int(m.group(1)), float(m.group(2))) for m in re.finditer(r"^step (\d+) loss (\S+)$", stdout, re.M)]


PLAIN = """
    import argparse, sys
    import torch, torch.nn as nn
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--code", type=int, default=0)
    p.add_argument("--raise-at", type=int, default=-1)
    a = p.parse_args()
    print("argv", sys.argv[1:], __name__)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    x = torch.randn(64, 8); y = x.sum(1, keepdim=True)
    for step in range(a.steps):
        if step == a.raise_at:
            raise RuntimeError("planted failure in the script")
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.9g}", flush=True)
    print("finished")
    sys.exit(a.code)
"""


def test_plain_loop_argv_output_exit_status_json_and_trace(tmp_path: Path) -> None:
    r = run(tmp_path, PLAIN, "--out", "o", "--json", "d.json", "SCRIPT", "--steps", "12", "--code", "4")
    assert r.returncode == 4, r.stderr
    assert "argv ['--steps', '12', '--code', '4'] __main__" in r.stdout
    assert "finished" in r.stdout
    seen = losses(r.stdout)
    assert [s for s, _ in seen] == list(range(12))
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["steps"] == 12 and data["exit_code"] == 4
    (model,) = data["models"]
    assert model["name"] == "Sequential" and model["steps"] == 12
    assert model["loss_steps"] == list(range(12))
    assert model["loss"] == pytest.approx([v for _, v in seen], rel=1e-6)
    for h in data["hypotheses"]:
        assert set(h) >= {"failure", "cause", "layer", "step", "confidence", "description", "remedies"}
    # The trace and the report are where the command says, and the trace is the same run.
    trace = tmp_path / "o" / "Sequential.ndbg"
    assert f"trace {os.path.join('o', 'Sequential.ndbg')}" in r.stderr
    assert (tmp_path / "o" / "Sequential.html").read_text().startswith("<!")
    loaded = neuraldbg.load(str(trace))
    assert loaded.step == 12
    _, trace_loss = loaded.history(None, "loss")
    assert list(trace_loss) == pytest.approx([v for _, v in seen], rel=1e-6)


def test_steps_stops_the_script_cleanly(tmp_path: Path) -> None:
    r = run(tmp_path, PLAIN, "--steps", "7", "--json", "d.json", "--out", "o", "SCRIPT", "--steps", "50", "--code", "9")
    assert r.returncode == 0, r.stderr
    # Stopped from the 7th optimizer.step(), before the script printed that step's line.
    seen = losses(r.stdout)
    assert [s for s, _ in seen] == list(range(6))
    assert "finished" not in r.stdout and "stopped the script: --steps 7" in r.stderr
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["steps"] == 7 and data["models"][0]["steps"] == 7 and data["stopped"] == "--steps 7"
    assert data["models"][0]["loss"][:6] == pytest.approx([v for _, v in seen], rel=1e-6)
    assert neuraldbg.load(str(tmp_path / "o" / "Sequential.ndbg")).step == 7


def test_a_script_that_raises_keeps_its_traceback_and_status_and_is_diagnosed(tmp_path: Path) -> None:
    r = run(tmp_path, PLAIN, "--out", "o", "--json", "d.json", "SCRIPT", "--raise-at", "5", "--lr", "3")
    assert r.returncode == 1
    assert "RuntimeError: planted failure in the script" in r.stderr
    assert 'train.py", line' in r.stderr and "Traceback" in r.stderr
    assert [s for s, _ in losses(r.stdout)] == list(range(5))
    assert "Sequential: 5 steps" in r.stderr  # the diagnosis, printed after the traceback
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["steps"] == 5 and data["exit_code"] == 1
    # lr 3 explodes this regression within the 5 steps: the diagnosis says so.
    assert data["hypotheses"][0]["failure"] in ("exploding_gradients", "loss_divergence", "non_finite")
    assert neuraldbg.load(str(tmp_path / "o" / "Sequential.ndbg")).step == 5


GAN = """
    import torch, torch.nn as nn
    class Generator(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        def forward(self, z):
            return self.net(z)
    class Discriminator(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        def forward(self, x):
            return self.net(x)
    torch.manual_seed(0)
    G, D = Generator(), Discriminator()
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
    bce = nn.BCEWithLogitsLoss()
    for it in range(10):
        real = torch.randn(32, 2) + 3
        fake = G(torch.randn(32, 4))
        opt_d.zero_grad()
        d_loss = bce(D(real), torch.ones(32, 1)) + bce(D(fake.detach()), torch.zeros(32, 1))
        d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        g_loss = bce(D(fake), torch.ones(32, 1))
        g_loss.backward()
        opt_g.step()
        print(f"it {it} d {d_loss.item():.9g} g {g_loss.item():.9g}", flush=True)
"""


def test_a_frozen_backbone_and_an_optimized_head_is_watched_as_the_whole_model(tmp_path: Path) -> None:
    """Transfer learning as the tutorials write it: the optimizer holds the head alone; the model
    the loop calls, backbone included, is what is watched (it was the head, a ``Linear``)."""
    script = """
        import torch, torch.nn as nn
        class Classifier(nn.Module):
            def __init__(self):
                super().__init__()
                self.backbone = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
                self.head = nn.Linear(32, 3)
            def forward(self, x):
                return self.head(self.backbone(x))
        torch.manual_seed(0)
        model = Classifier()
        for p in model.backbone.parameters():
            p.requires_grad_(False)
        opt = torch.optim.Adam(model.head.parameters(), lr=1e-2)
        x = torch.randn(64, 8); y = x[:, :3].argmax(1)
        for step in range(10):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    """
    r = run(tmp_path, script, "--out", "o", "--json", "d.json")
    assert r.returncode == 0, r.stderr
    (model,) = json.loads((tmp_path / "d.json").read_text())["models"]
    assert model["name"] == "Classifier" and model["steps"] == 10
    loaded = neuraldbg.load(str(tmp_path / "o" / "Classifier.ndbg"))
    for layer in ("backbone.1", "backbone.3"):  # the backbone's activations are measured
        steps, dead = loaded.history(layer, "dead_fraction")
        assert len(steps) > 0 and np.isfinite(dead).all(), layer


def test_a_script_that_never_steps_its_optimizer_is_told_so_and_ends_as_it_would(tmp_path: Path) -> None:
    script = """
        import torch, torch.nn as nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x = torch.randn(64, 8); y = x.sum(1, keepdim=True)
        for step in range(10):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()   # and no opt.step()
        print("finished")
    """
    r = run(tmp_path, script, "--out", "o", "--json", "d.json")
    assert r.returncode == 0, r.stderr
    assert "finished" in r.stdout and "Traceback" not in r.stderr, r.stderr
    assert (
        "Sequential: 0 steps: backward passes gave Sequential gradients, but no optimizer.step() on its "
        "parameters followed: it did not train" in r.stderr
    )
    (model,) = json.loads((tmp_path / "d.json").read_text())["models"]
    assert model["steps"] == 0 and model["loss"] == []


def test_a_script_that_updates_its_weights_by_hand_is_watched_from_its_first_step(tmp_path: Path) -> None:
    # No optimizer to find the model by (PyTorch's "What is torch.nn really?" loop): the model
    # is found at the first backward pass, and every iteration is a step, the first included.
    script = """
        import torch, torch.nn as nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        x = torch.randn(64, 8); y = x.sum(1, keepdim=True)
        for step in range(20):
            batch = x.clone()
            if step == 12:
                batch[3, 2] = float("nan")
            loss = nn.functional.mse_loss(model(batch), y)
            loss.backward()
            g = model[0]
            print("step", step, "loss", float(loss), "grad", float(torch.cat([g.weight.grad.flatten(), g.bias.grad]).norm()))
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
            model.zero_grad()
        print("finished")
    """
    r = run(tmp_path, script, "--out", "o", "--json", "d.json")
    assert r.returncode == 0, r.stderr
    assert "finished" in r.stdout and "Traceback" not in r.stderr, r.stderr
    printed = re.findall(r"^step (\d+) loss (\S+) grad (\S+)$", r.stdout, re.M)
    loaded = neuraldbg.load(str(tmp_path / "o" / "Sequential.ndbg"))
    assert loaded.step == 20
    steps, grads = loaded.history("0")
    assert list(steps) == list(range(20))
    np.testing.assert_allclose(grads[:12], [float(g) for _, _, g in printed[:12]], rtol=1e-5)
    steps, loss = loaded.history(None, "loss")
    np.testing.assert_allclose(loss[:12], [float(v) for _, v, _ in printed[:12]], rtol=1e-5)
    top = json.loads((tmp_path / "d.json").read_text())["hypotheses"][0]
    assert (top["failure"], top["cause"], top["step"]) == ("data_anomaly", "bad_input_data", 12), top

    r = run(tmp_path, script, "--steps", "7", "--out", "o7")
    assert r.returncode == 0, r.stderr
    assert "stopped the script: --steps 7" in r.stderr and "finished" not in r.stdout, r.stderr
    assert len(re.findall(r"^step ", r.stdout, re.M)) == 7
    assert neuraldbg.load(str(tmp_path / "o7" / "Sequential.ndbg")).step == 7


def test_a_script_whose_weights_are_bare_tensors_is_told_what_can_be_watched(tmp_path: Path) -> None:
    # The first loop of "What is torch.nn really?": weights as tensors, no module to watch.
    script = """
        import torch
        torch.manual_seed(0)
        w = torch.randn(8, 1, requires_grad=True)
        x = torch.randn(64, 8); y = x.sum(1, keepdim=True)
        for step in range(5):
            ((x @ w - y) ** 2).mean().backward()
            with torch.no_grad():
                w -= 0.01 * w.grad
                w.grad.zero_()
        print("finished")
    """
    r = run(tmp_path, script)
    assert r.returncode == 0, r.stderr
    assert "finished" in r.stdout and "Traceback" not in r.stderr, r.stderr
    assert "no model was trained" in r.stderr and "bare tensors" in r.stderr, r.stderr


def test_an_optimizer_made_before_the_model_was_re_created_is_told_so(tmp_path: Path) -> None:
    """The optimizer holds the first model's parameters; the loop trains a second one, which
    no optimizer steps. What is watched is what the optimizer holds: it never runs."""
    script = """
        import torch, torch.nn as nn
        def make():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model = make()   # re-created after the optimizer
        before = [p.detach().clone() for p in model.parameters()]
        x = torch.randn(64, 8); y = x.sum(1, keepdim=True)
        for step in range(12):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        print("unchanged", all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    """
    r = run(tmp_path, script, "--out", "o")
    assert r.returncode == 0, r.stderr
    assert "unchanged True" in r.stdout, "the loop's model never trained"
    assert (
        "Sequential: 0 steps: the optimizer holding Sequential's parameters stepped 12 times, but Sequential "
        "ran no forward pass and got no gradient: the loop trains another model" in r.stderr
    )


def test_gan_generator_and_discriminator_each_watched_under_their_own_name(tmp_path: Path) -> None:
    r = run(tmp_path, GAN, "--out", "o", "--json", "d.json", "SCRIPT")
    assert r.returncode == 0, r.stderr
    printed = re.findall(r"^it (\d+) d (\S+) g (\S+)$", r.stdout, re.M)
    assert len(printed) == 10
    data = json.loads((tmp_path / "d.json").read_text())
    models = {m["name"]: m for m in data["models"]}
    assert set(models) == {"Generator", "Discriminator"}
    assert models["Generator"]["steps"] == models["Discriminator"]["steps"] == 10
    # The generator's loss is the only one whose backward reaches it. (The discriminator's
    # parameters get gradients from both losses: which one it records is the collector's choice.)
    assert models["Generator"]["loss"] == pytest.approx([float(g) for _, _, g in printed], rel=1e-6)
    for name in models:
        assert neuraldbg.load(str(tmp_path / "o" / f"{name}.ndbg")).step == 10
        assert f"{name}: 10 steps" in r.stderr


def test_module_form_and_bad_options(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "trainmod.py").write_text(textwrap.dedent(PLAIN))
    cmd = [
        sys.executable,
        "-m",
        "neuraldbg",
        "run",
        "--json",
        "m.json",
        "--out",
        "o",
        "-m",
        "pkg.trainmod",
        "--steps",
        "3",
    ]
    r = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "argv ['--steps', '3'] __main__" in r.stdout
    assert json.loads((tmp_path / "m.json").read_text())["steps"] == 3
    bad = run(tmp_path, PLAIN, "-o", "threshold_vanishing=-1", "SCRIPT")
    assert bad.returncode == 2 and "threshold_vanishing" in bad.stderr and "argv" not in bad.stdout
    unknown = run(tmp_path, PLAIN, "-o", "no_such_option=1", "SCRIPT")
    assert unknown.returncode == 2 and "no_such_option" in unknown.stderr


def test_help_lists_run() -> None:
    out = subprocess.run([sys.executable, "-m", "neuraldbg", "--help"], env=_env(), capture_output=True, text=True)
    assert re.search(r"^\s+run\s", out.stdout, re.M), out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "neuraldbg", "run", "--help"], env=_env(), capture_output=True, text=True
    )
    assert out.returncode == 0 and "--confirm" in out.stdout and "SCRIPT" in out.stdout


LIGHTNING = """
    import torch, torch.nn as nn, lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
            self.head = nn.Linear(16, 1)
        def training_step(self, batch, i):
            x, y = batch
            loss = nn.functional.mse_loss(self.head(self.body(x)), y)
            print(f"step {self.global_step} loss {loss.item():.9g}", flush=True)
            return loss
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)
    torch.manual_seed(0)
    x = torch.randn(64, 8); y = x.sum(1, keepdim=True)
    trainer = L.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(Net(), DataLoader(TensorDataset(x, y), batch_size=16))
    print("global_step", trainer.global_step)
"""


def test_lightning_script(tmp_path: Path) -> None:
    r = run(tmp_path, LIGHTNING, "--json", "d.json", "--out", "o", "SCRIPT")
    assert r.returncode == 0, r.stderr
    global_step = int(re.search(r"^global_step (\d+)$", r.stdout, re.M).group(1))  # type: ignore[union-attr]
    data = json.loads((tmp_path / "d.json").read_text())
    (model,) = data["models"]
    assert model["name"] == "Net"  # the LightningModule, found though its forward never runs
    assert data["steps"] == global_step == 6
    assert model["loss"] == pytest.approx([v for _, v in losses(r.stdout)], rel=1e-6)


HF = """
    import torch, torch.nn as nn
    from transformers import Trainer, TrainingArguments
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": nn.functional.mse_loss(out, labels), "logits": out}
    class Data(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(64, 8, generator=g); self.y = self.x.sum(1, keepdim=True)
        def __len__(self): return 64
        def __getitem__(self, i): return {"x": self.x[i], "labels": self.y[i]}
    torch.manual_seed(0)
    args = TrainingArguments(output_dir="hf_out", max_steps=5, per_device_train_batch_size=16, report_to=[],
                             use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=Tiny(), args=args, train_dataset=Data())
    trainer.train()
    print("global_step", trainer.state.global_step)
"""


def test_hugging_face_trainer_script(tmp_path: Path) -> None:
    r = run(tmp_path, HF, "--json", "d.json", "--out", "o", "SCRIPT")
    assert r.returncode == 0, r.stderr
    global_step = int(re.search(r"^global_step (\d+)$", r.stdout, re.M).group(1))  # type: ignore[union-attr]
    data = json.loads((tmp_path / "d.json").read_text())
    assert [m["name"] for m in data["models"]] == ["Tiny"]
    assert data["steps"] == global_step == 5


ACCELERATE = """
    import torch, torch.nn as nn
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(64, 8); y = x.sum(1, keepdim=True)
    for step in range(5):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        print(f"step {step} loss {loss.item():.9g}", flush=True)
"""


def test_accelerate_script(tmp_path: Path) -> None:
    r = run(tmp_path, ACCELERATE, "--json", "d.json", "--out", "o", "SCRIPT")
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "d.json").read_text())
    (model,) = data["models"]
    assert data["steps"] == 5 and model["loss"] == pytest.approx([v for _, v in losses(r.stdout)], rel=1e-6)


DDP = """
    import os, torch, torch.nn as nn, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for step in range(6):
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        opt.step()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()
"""


def test_torchrun_two_processes_one_diagnosis(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(DDP))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "-m",
        "neuraldbg",
        "run",
        "--json",
        "d.json",
        "--out",
        "o",
        "train.py",
    ]
    r = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "rank 0 done" in r.stdout and "rank 1 done" in r.stdout
    assert r.stderr.count("DistributedDataParallel: 6 steps") == 1  # one diagnosis for the job
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["steps"] == 6 and [m["name"] for m in data["models"]] == ["DistributedDataParallel"]
    assert neuraldbg.load(str(tmp_path / "o" / "DistributedDataParallel.ndbg")).meta.get("world_size") == 2


def _verdicts(data: Dict[str, Any]) -> List[Tuple[str, str, str]]:
    return [(h["failure"], h["cause"], h.get("verdict", "")) for h in data["hypotheses"]]


def test_confirm_a_planted_learning_rate(tmp_path: Path) -> None:
    # lr 1.0 is 20x this regression's working 0.05: gradients explode within a few steps.
    r = run(
        tmp_path,
        PLAIN,
        "--confirm",
        "--confirm-top",
        "5",
        "--jobs",
        "2",
        "--json",
        "d.json",
        "--out",
        "o",
        "SCRIPT",
        "--steps",
        "30",
        "--lr",
        "1.0",
    )
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "d.json").read_text())
    top = data["hypotheses"][0]
    assert top["cause"] == "learning_rate_too_high" and top["verdict"] == "confirmed", _verdicts(data)
    ev = top["evidence"]
    assert ev["failure_in_unchanged"] and not ev["failure_recurred"]
    assert ev["loss_unchanged"] is None and ev["loss"] is not None  # non-finite unchanged, finite remedied
    assert top["intervention"].startswith("learning rate x0.1")
    # Every other hypothesis listed, tested or not, is never confirmed by the learning-rate re-runs.
    others = [h for h in data["hypotheses"] if h["cause"] not in ("learning_rate_too_high", "numerical_instability")]
    assert others and all(h["verdict"] in ("untested", "refuted", "inconclusive") for h in others), _verdicts(data)
    assert "CONFIRMED" in r.stderr


DEAD_AT_START = """
    import torch, torch.nn as nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    with torch.no_grad():
        model[0].bias.fill_(-20.0)  # planted: a bias that leaves every ReLU unit dead from the start
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    x = torch.randn(64, 8); y = x.sum(1, keepdim=True)
    for step in range(40):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.9g}", flush=True)
"""


def test_confirm_a_planted_initialization_and_not_the_dying_relu_it_looks_like(tmp_path: Path) -> None:
    r = run(tmp_path, DEAD_AT_START, "--confirm", "--jobs", "2", "--json", "d.json", "--out", "o", "SCRIPT")
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "d.json").read_text())
    top = data["hypotheses"][0]
    assert (top["failure"], top["cause"], top["verdict"]) == ("dead_neurons", "poor_initialization", "confirmed"), (
        _verdicts(data)
    )
    # The dead ReLU has no weights: the layer feeding it is the one re-initialized.
    assert top["evidence"]["applied"] == ["0 (the layer before 1) re-initialized (1 module(s) reset)"]
    # LeakyReLU keeps the units from being dead but does not make this regression learn.
    relu = [h for h in data["hypotheses"] if h["cause"] == "dying_relu"]
    assert relu and all(h["verdict"] in ("inconclusive", "refuted") for h in relu), _verdicts(data)
    assert [h for h in data["hypotheses"] if h.get("verdict") == "confirmed"] == [
        h for h in data["hypotheses"] if h["cause"] == "poor_initialization" and h.get("verdict") == "confirmed"
    ]
    # The script's own printed losses: the re-initialized re-run learns, the unchanged one does not.
    runs = {Path(run["folder"]).name: run for run in data["confirm"]["runs"]}
    (reinit,) = [name for name in runs if name.endswith("-reinit")]
    own = {name: losses((tmp_path / "o" / "confirm" / f"{name}.log").read_text()) for name in ("unchanged", reinit)}
    assert own["unchanged"][-1][1] > 0.9 * own["unchanged"][0][1]
    assert own[reinit][-1][1] < 0.2 * own["unchanged"][-1][1]
    # `explain` and the report of the trace show the verdicts, confirmed first, and the curves.
    trace = str(tmp_path / "o" / "Sequential.ndbg")
    explained = subprocess.run(
        [sys.executable, "-m", "neuraldbg", "explain", trace, "--json"], env=_env(), capture_output=True, text=True
    )
    assert explained.returncode == 0, explained.stderr
    listed = json.loads(explained.stdout)
    assert (listed[0]["cause"], listed[0]["verdict"]) == ("poor_initialization", "confirmed")
    assert listed[0]["evidence"]["loss"] == pytest.approx(top["evidence"]["loss"])
    assert {h["verdict"] for h in listed if h["cause"] == "dying_relu"} <= {"inconclusive", "refuted"}
    text = subprocess.run(
        [sys.executable, "-m", "neuraldbg", "explain", trace], env=_env(), capture_output=True, text=True
    ).stdout
    assert text.splitlines()[1].startswith("    CONFIRMED: the weights of 1")
    page = (tmp_path / "o" / "Sequential.html").read_text()
    assert '<div class="tried confirmed">' in page and '<div class="tried inconclusive">' in page
    shown = json.loads(re.search(r'id="ndbg-data">(.*?)</script>', page, re.S).group(1))["confirm"]
    assert [c["name"] for c in shown["curves"]][:2] == ["first run", "unchanged re-run"]
    assert len(shown["curves"]) == 2 + len(data["confirm"]["runs"]) - 1
    # Each tried remedy says where its run parted from the unchanged one (neuraldbg diff).
    parts = next(
        s for (s, x), (_, y) in zip(own["unchanged"], own[reinit]) if not abs(x - y) <= 0.01 * max(abs(x), abs(y))
    )
    assert top["evidence"]["parts_from_unchanged"]["loss_step"] == parts


def test_confirm_on_a_healthy_program_confirms_nothing(tmp_path: Path) -> None:
    r = run(tmp_path, PLAIN, "--confirm", "--jobs", "2", "--json", "d.json", "--out", "o", "SCRIPT", "--steps", "15")
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "d.json").read_text())
    assert not [h for h in data["hypotheses"] if h.get("verdict") == "confirmed"], _verdicts(data)
    assert data["confirm"]["runs"][0]["intervention"] is None  # the unchanged re-run was made


def _train_to_trace(path: Path, lr: float, steps: int = 20) -> List[float]:
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    seen = []
    with neuraldbg.NeuralDbg(model, trace=str(path)):
        for _ in range(steps):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            seen.append(loss.item())
    return seen


def _diff(a: Path, b: Path) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "neuraldbg", "diff", str(a), str(b), "--json"]
    out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def test_diff_says_where_two_runs_part(tmp_path: Path) -> None:
    good = _train_to_trace(tmp_path / "good.ndbg", 0.05)
    bad = _train_to_trace(tmp_path / "bad.ndbg", 1.0)
    _train_to_trace(tmp_path / "again.ndbg", 0.05)
    d = _diff(tmp_path / "good.ndbg", tmp_path / "bad.ndbg")
    # The losses part where the scripts' own losses first differ by more than 1%.
    apart = next(i for i, (x, y) in enumerate(zip(good, bad)) if not abs(x - y) <= 0.01 * max(abs(x), abs(y)))
    assert d["loss_parting_step"] == apart
    assert d["loss"]["a"]["values"] == pytest.approx(good, rel=1e-6)
    assert d["parting"] is not None and d["parting"]["b"] in ("EXPLODING", "NON_FINITE", "DIVERGING")
    assert any(e["to_state"] == "EXPLODING" for e in d["only_b"])
    same = _diff(tmp_path / "good.ndbg", tmp_path / "again.ndbg")
    assert same["parting"] is None and same["only_a"] == same["only_b"] == [] and same["loss_parting_step"] is None
    text = subprocess.run(
        [sys.executable, "-m", "neuraldbg", "diff", str(tmp_path / "good.ndbg"), str(tmp_path / "bad.ndbg")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert f"The runs part at step {d['parting']['step']}" in text and "Events only in B:" in text
    # The same comparison as a page: both loss curves, where they part, the events only B has.
    page_cmd = [sys.executable, "-m", "neuraldbg", "diff", str(tmp_path / "good.ndbg"), str(tmp_path / "bad.ndbg")]
    done = subprocess.run([*page_cmd, "--html", str(tmp_path / "d.html")], env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "d.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert f"The runs part at step {d['parting']['step']}:" in page
    assert f"The loss curves part at step {apart}" in page
    assert page.count('stroke-width="1.6"') == 2  # one curve per run
    assert f'Events only in <span class="b">B</span> ({len(d["only_b"])})' in page


KERAS = """
    import argparse, sys
    import numpy as np
    import keras
    p = argparse.ArgumentParser()
    p.add_argument("--nan-at", type=int, default=-1)
    a = p.parse_args()
    x = np.random.default_rng(0).normal(size=(640, 16)).astype("float32")
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2]).astype("float32")
    if a.nan_at >= 0:
        x[a.nan_at * 32 + 1, 3] = np.nan
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(32, activation="sigmoid", name=f"h{i}") for i in range(12)]
    model = keras.Sequential([keras.Input((16,)), *layers, keras.layers.Dense(1, name="out")])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")

    class Losses(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            print("batch", batch, flush=True)

    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, callbacks=[Losses()], verbose=0)
    print("iterations", int(keras.ops.convert_to_numpy(model.optimizer.iterations)))
    print("torch imported", "torch" in sys.modules)
"""


def _needs(*modules: str) -> None:
    """Skips unless the script's frameworks are installed, importing none of them here (Keras
    would bring TensorFlow into this process, where torch's compiler later aborts)."""
    import importlib.util

    for m in modules:
        if importlib.util.find_spec(m) is None:
            pytest.skip(f"{m} is not installed")


def _keras_env(monkeypatch: Any) -> None:
    _needs("keras", "jax")
    monkeypatch.setenv("KERAS_BACKEND", "jax")


def test_a_keras_script_unchanged(tmp_path: Path, monkeypatch: Any) -> None:
    """Each ``model.fit`` of a Keras script gets the callback, the user's own beside it: the
    deep sigmoid stack's vanishing gradients named at the right layer, every batch a step, the
    trace the same run; torch is not imported for it. ``--steps`` stops the script between
    batches; ``--halt-on`` stops it at a NaN batch (exit 3)."""
    _keras_env(monkeypatch)
    r = run(tmp_path, KERAS, "--json", "d.json", "--out", "o", "SCRIPT", timeout=400)
    assert r.returncode == 0, r.stderr
    iterations = int(re.search(r"^iterations (\d+)$", r.stdout, re.M).group(1))  # type: ignore[union-attr]
    assert iterations == 40 and "torch imported False" in r.stdout
    assert r.stdout.count("batch ") == 40  # the script's own callback still ran
    data = json.loads((tmp_path / "d.json").read_text())
    (model,) = data["models"]
    assert model["name"] == "Sequential" and model["steps"] == data["steps"] == iterations
    top = data["hypotheses"][0]
    assert (top["failure"], top["cause"]) == ("vanishing_gradients", "saturating_activation")
    assert top["confidence"] >= 0.5 and top["layer"].startswith("h")
    assert neuraldbg.load(str(tmp_path / "o" / "Sequential.ndbg")).step == iterations
    assert (tmp_path / "o" / "Sequential.html").read_text().startswith("<!")

    r = run(tmp_path, KERAS, "--steps", "7", "--json", "d.json", "--out", "o7", "SCRIPT", timeout=400)
    assert r.returncode == 0, r.stderr
    assert "stopped the script: --steps 7" in r.stderr and "iterations" not in r.stdout
    assert r.stdout.count("batch ") == 7
    assert neuraldbg.load(str(tmp_path / "o7" / "Sequential.ndbg")).step == 7

    r = run(tmp_path, KERAS, "--halt-on", "data_anomaly", "--json", "d.json", "--out", "oh", "SCRIPT", "--nan-at", "5")
    assert r.returncode == 3, r.stderr
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["stopped"].startswith("halted") and "iterations" not in r.stdout
    assert data["steps"] == 7  # the NaN batch 5, confirmed before batch 6, which Keras still trains
    assert data["hypotheses"][0]["failure"] == "data_anomaly" and data["hypotheses"][0]["step"] == 5


def test_a_keras_fit_on_the_torch_backend_is_watched_once(tmp_path: Path, monkeypatch: Any) -> None:
    """On Keras' torch backend the fit's backward passes are torch's and no torch optimizer is
    made: the fit is its callback's to watch, not a loop that updates its weights by hand."""
    _needs("keras", "torch")
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    r = run(tmp_path, KERAS, "--json", "d.json", "--out", "o", "SCRIPT", timeout=400)
    assert r.returncode == 0, r.stderr
    assert "could not watch" not in r.stderr and "cannot watch" not in r.stderr, r.stderr
    data = json.loads((tmp_path / "d.json").read_text())
    (model,) = data["models"]
    assert (model["name"], model["steps"], data["steps"]) == ("Sequential", 40, 40)


FLAX = """
    import sys
    import numpy as np, jax, jax.numpy as jnp, optax
    from flax import nnx, linen
    from flax.training import train_state

    x = np.random.default_rng(0).normal(size=(640, 8)).astype("float32")
    y = 3 * x[:, :1]

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(8, 32, rngs=rngs)
            self.b = nnx.Linear(32, 1, rngs=rngs)
        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(2.5), wrt=nnx.Param)  # far too high

    @nnx.jit
    def step(model, opt, xb, yb):
        loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(xb) - yb) ** 2))(model)
        opt.update(model, g, value=loss)
        return loss

    for i in range(30):
        step(model, opt, x[i % 20 * 32 : (i % 20 + 1) * 32], y[i % 20 * 32 : (i % 20 + 1) * 32])
    print("nnx steps", int(opt.step.value))

    class Linen(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(1)(jnp.tanh(linen.Dense(16)(x)))

    net = Linen()
    accumulating = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=3)
    state = train_state.TrainState.create(apply_fn=net.apply, params=net.init(jax.random.key(0), x[:1]), tx=accumulating)

    @jax.jit
    def linen_step(state, xb, yb):
        g = jax.grad(lambda p: jnp.mean((state.apply_fn(p, xb) - yb) ** 2))(state.params)
        return state.apply_gradients(grads=g)

    for i in range(12):
        state = linen_step(state, x[i * 32 : (i + 1) * 32], y[i * 32 : (i + 1) * 32])
    print("linen steps", int(state.step))

    from neuraldbg.jax import NeuralDbg  # a model the script watches itself: not twice
    own = MLP(nnx.Rngs(1))
    with NeuralDbg(own) as dbg:
        own_opt = nnx.Optimizer(own, optax.MultiSteps(dbg.wrap(optax.sgd(0.01)), every_k_schedule=2), wrt=nnx.Param)
        for i in range(6):
            step(own, own_opt, x[:32], y[:32])
    print("own steps", dbg.step)
    print("torch imported", "torch" in sys.modules)
"""


def test_a_flax_script_unchanged(tmp_path: Path) -> None:
    """An nnx ``Optimizer`` and a linen ``TrainState`` each watched under their model's name,
    their transformations wrapped (the TrainState's ``optax.MultiSteps`` of 3 micro-batches: one
    step per update; a model the script watches itself inside a ``MultiSteps`` is not watched
    twice): the learning rate far too high is named from the nnx run,
    whose loss arrives as the step passes it (``value=``); the steps are the script's own.
    ``--steps`` and ``--halt-on`` stop the compiled loop at the script's next call."""
    _needs("flax", "optax")
    r = run(tmp_path, FLAX, "--json", "d.json", "--out", "o", "SCRIPT", timeout=400)
    assert r.returncode == 0, r.stderr
    assert "nnx steps 30" in r.stdout and "linen steps 12" in r.stdout and "torch imported False" in r.stdout
    assert "own steps 3" in r.stdout
    data = json.loads((tmp_path / "d.json").read_text())
    assert [(m["name"], m["steps"]) for m in data["models"]] == [("MLP", 30), ("Linen", 4)]
    mlp = [h for h in data["hypotheses"] if h["model"] == "MLP"]
    assert mlp[0]["cause"] == "learning_rate_too_high" and mlp[0]["confidence"] >= 0.5
    # (a TrainState's apply_gradients passes no loss: its steps have none)
    assert len(data["models"][0]["loss"]) == 30 and data["models"][1]["loss"] in ([], [None] * 4)
    assert neuraldbg.load(str(tmp_path / "o" / "MLP.ndbg")).step == 30

    # A compiled loop is stopped where the host reads a newer state: the script's next call.
    r = run(tmp_path, FLAX, "--steps", "10", "--json", "d.json", "--out", "o10", "SCRIPT", timeout=400)
    assert r.returncode == 0, r.stderr
    assert "stopped the script: --steps 10" in r.stderr and "nnx steps" not in r.stdout
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["steps"] == 10 and neuraldbg.load(str(tmp_path / "o10" / "MLP.ndbg")).step == 10
    r = run(tmp_path, FLAX, "--halt-on", "exploding_gradients", "--json", "d.json", "--out", "oh", "SCRIPT")
    assert r.returncode == 3, r.stderr
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["stopped"].startswith("halted") and "nnx steps" not in r.stdout
    assert data["hypotheses"][0]["failure"] == "exploding_gradients" and data["steps"] < 30


FLAX_SOFTMAX = """
import sys
import numpy as np
import jax, optax
from flax import nnx
from optax import softmax_cross_entropy_with_integer_labels as xent  # bound at import time

rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype(np.float32)
y = np.argmax(x @ rng.normal(size=(8, 4)), 1)

class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, v):
        return nnx.softmax(self.l2(nnx.relu(self.l1(v))))  # probabilities into a loss of logits

model = Net(nnx.Rngs(0))
opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

@nnx.jit
def step(model, opt, xb, yb):
    loss, g = nnx.value_and_grad(lambda m: xent(m(xb), yb).mean())(model)
    opt.update(model, g, value=loss)
    return loss

for i in range(200):
    j = i * 64 % 512
    loss = step(model, opt, x[j : j + 64], y[j : j + 64])
print("loss", float(loss))
"""


def test_a_flax_script_that_imports_its_optax_loss_by_name_is_read(tmp_path: Path) -> None:
    """`from optax import X` binds the loss before any debugger exists: the run command notes
    optax's losses from the script's import of optax on, so the softmax fed to a loss that
    applies its own is named."""
    _needs("flax", "optax")
    r = run(tmp_path, FLAX_SOFTMAX, "--json", "d.json", "--out", "o", "SCRIPT", timeout=400)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "d.json").read_text())
    top = data["hypotheses"][0]
    assert (top["failure"], top["cause"]) == ("loss_plateau", "output_loss_mismatch"), top
    assert "softmax_cross_entropy expects raw logits" in top["description"], top


def test_halt_on_stops_training_at_a_confirmed_failure(tmp_path: Path) -> None:
    r = run(
        tmp_path,
        PLAIN,
        "--halt-on",
        "non_finite",
        "--json",
        "d.json",
        "--out",
        "o",
        "SCRIPT",
        "--steps",
        "30",
        "--lr",
        "1.0",
    )
    assert r.returncode == 3, r.stderr
    printed = losses(r.stdout)
    assert printed and len(printed) < 30 and "finished" not in r.stdout
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["stopped"].startswith("halted") and data["steps"] == len(printed) + 1
    assert any(h["failure"] == "non_finite" and h["confidence"] >= 0.5 for h in data["hypotheses"])


def test_ctrl_c_still_gives_the_diagnosis_trace_and_report(tmp_path: Path) -> None:
    import signal

    (tmp_path / "train.py").write_text(textwrap.dedent(PLAIN))
    cmd = [sys.executable, "-m", "neuraldbg", "run", "--json", "d.json", "--out", "o", "train.py", "--steps", "100000"]
    # A test run started in the background (`make test &`, a CI shell without job control)
    # ignores SIGINT, and a child inherits that: the script would never see the Ctrl-C. The
    # child is started with SIGINT handled, as from a terminal.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 3 "):
            break
    proc.send_signal(signal.SIGINT)
    _rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "stopped the script: interrupted" in err and "Sequential:" in err
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["steps"] >= 4 and data["stopped"] == "interrupted"
    # However Ctrl-C lands (between a backward and its optimizer step too), a forward it cut
    # short is no step: the trace holds the completed optimizer steps.
    assert neuraldbg.load(str(tmp_path / "o" / "Sequential.ndbg")).step == data["steps"]
    assert (tmp_path / "o" / "Sequential.html").exists()


def _small_regression() -> Tuple[Any, Any, Any, Any]:
    """The PLAIN script's model, optimizer and batch, in process."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    return model, opt, x, y


def test_ctrl_c_between_backward_and_step_is_not_a_step(tmp_path: Path) -> None:
    """The in-code API, with Ctrl-C placed exactly between a backward and its optimizer step."""
    import torch.nn as nn

    model, opt, x, y = _small_regression()
    completed = 0
    with pytest.raises(KeyboardInterrupt), neuraldbg.NeuralDbg(model, trace=str(tmp_path / "t.ndbg")) as dbg:
        for step in range(10):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if step == 6:
                raise KeyboardInterrupt
            opt.step()
            completed += 1
    assert completed == 6 and dbg.step == 6
    assert neuraldbg.load(str(tmp_path / "t.ndbg")).step == 6


@pytest.mark.parametrize("where", ["end_step", "_count_step"])
def test_ctrl_c_after_a_step_reached_the_engine_still_counts_it(tmp_path: Path, monkeypatch: Any, where: str) -> None:
    """Ctrl-C raises at whatever line runs: here after step 4 was handed to the engine and
    before it was counted (the CI flake of the command's Ctrl-C test)."""
    import torch.nn as nn

    from neuraldbg._boundary import StepBoundary

    own = getattr(StepBoundary, where)
    fired = []

    def interrupted(self: Any, *args: Any) -> Any:
        if self.c.step == 4 and not fired and not (args and args[0]):
            fired.append(where)
            raise KeyboardInterrupt
        return own(self, *args)

    monkeypatch.setattr(StepBoundary, where, interrupted)
    model, opt, x, y = _small_regression()
    completed = 0
    with pytest.raises(KeyboardInterrupt), neuraldbg.NeuralDbg(model, trace=str(tmp_path / "t.ndbg")) as dbg:
        for _ in range(10):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            completed += 1  # the optimizer step below completes; its post-hook is interrupted
            opt.step()
    assert fired == [where] and completed == 5
    assert dbg.step == 5
    assert neuraldbg.load(str(tmp_path / "t.ndbg")).step == 5


def test_each_remedy_does_what_it_says() -> None:
    """The remedies ``--confirm`` applies in its runs, checked in process against torch."""
    import torch
    import torch.nn as nn

    from neuraldbg._confirm import Remedy

    def setup(kind: str, value: Any = None, layer: Any = None) -> Tuple[nn.Module, Remedy, List[str]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.Softmax(dim=1))
        notes: List[str] = []
        remedy = Remedy({"model": "Sequential", "kind": kind, "value": value, "layer": layer}, notes)
        remedy.model_found("Sequential", model)
        return model, remedy, notes

    x = torch.randn(16, 4) * 50 + 7

    # Learning rate: the step moves the weights by 0.1 x lr x grad; the schedule's lr is kept.
    model, remedy, notes = setup("lr_scale", 0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    remedy.optimizer_made(opt)
    model(x).sum().backward()
    w0, g = model[0].weight.detach().clone(), model[0].weight.grad.clone()
    opt.step()
    assert torch.allclose(model[0].weight, w0 - 0.05 * g) and opt.param_groups[0]["lr"] == 0.5
    assert notes == ["learning rate x0.1 in SGD"]
    remedy.remove()

    # zero_grad after each step; clipping before it.
    model, remedy, _ = setup("zero_grad")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    remedy.optimizer_made(opt)
    model(x).sum().backward()
    opt.step()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    model, remedy, _ = setup("clip", 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    remedy.optimizer_made(opt)
    (model[2](model[1](model[0](x))) ** 2).sum().backward()
    assert torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) > 1.0
    opt.step()
    assert torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]) == pytest.approx(1.0, rel=1e-4)

    # Module surgery: LeakyReLU for ReLU, the output softmax gone, a layer re-initialized.
    model, _, notes = setup("leaky_relu")
    assert isinstance(model[1], nn.LeakyReLU) and notes == ["1 nn.ReLU replaced by LeakyReLU(0.01)"]
    model, _, _ = setup("remove_output_activation", layer="3")
    assert isinstance(model[3], nn.Identity)
    torch.manual_seed(0)
    planted = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        planted[2].weight.fill_(5.0)
    Remedy({"kind": "reinit", "layer": "2"}, notes := []).model_found("Sequential", planted)
    assert planted[2].weight.abs().max() <= 1 / 8**0.5 and notes == ["2 re-initialized (1 module(s) reset)"]
    # A layer without weights (a dead ReLU): the layer before it is re-initialized.
    with torch.no_grad():
        planted[0].bias.fill_(-20.0)
    Remedy({"kind": "reinit", "layer": "1"}, notes := []).model_found("Sequential", planted)
    assert planted[0].bias.abs().max() <= 1 / 4**0.5 and notes == [
        "0 (the layer before 1) re-initialized (1 module(s) reset)"
    ]

    # Training mode before each forward; inputs standardized with the first batch's statistics.
    model, remedy, _ = setup("train_mode")
    model.eval()
    model(x)
    assert model.training and model[0].training
    model, remedy, _ = setup("standardize")
    seen: List[Any] = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    model(x)
    assert seen[0].mean(0).abs().max() < 1e-4 and torch.allclose(seen[0].std(0), torch.ones(4), atol=1e-4)

    # Parameters missing from the optimizer are added to it.
    model, remedy, notes = setup("add_parameters")
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    remedy.optimizer_made(opt)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) in held for p in model.parameters()) and notes[0].startswith("2 parameter(s) added")

    # A remedy that does not fit the script says so.
    plain = nn.Sequential(nn.Linear(4, 3))
    Remedy({"kind": "leaky_relu"}, notes := []).model_found("Sequential", plain)
    assert notes[0].startswith("not applicable")
