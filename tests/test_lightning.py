"""Lightning and Accelerate: a run stopped at a mid-epoch checkpoint and resumed trains on the same
micro-batches, with the same losses and bit-equal weights, as an uninterrupted run; serial, async and
worker loading, gradient accumulation, loader and Lightning epochs, DDP on CPU; a mis-wired Trainer is
refused at fit start."""

import glob
import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from portable_loader.adapters.torch import TorchLoader

# Lightning (and lightning_job, which imports it) only inside the tests: importing it costs seconds in
# every test process that collects this module.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from lightning_job import make_cache

    return make_cache(str(tmp_path_factory.mktemp("c")))


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


class CountingLoader(TorchLoader):
    """Counts the batches handed out: a resume that replayed the stream would hand out more."""

    handed = 0

    def __next__(self):
        batch = super().__next__()
        self.handed += 1
        return batch


def plain(cache, mode, n, global_batch_size=4, shard=None):
    """The oracle: digests and states of the first ``n`` batches of a TorchLoader iterated by hand."""
    from lightning_job import MODES, digest, make_loader

    loader = make_loader(cache, mode, global_batch_size)
    if shard is not None:
        loader = loader.with_shard(shard, 2)
    with TorchLoader(loader, **MODES[mode]["torch"]) as tl:
        out = [(digest(next(tl)), tl.state_dict()) for _ in range(n)]
    return [d for d, _ in out], [s for _, s in out]


def stored_state(ckpt):
    return torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]


def fit(cache, out, mode, ckpt=None, **kw):
    from lightning_job import TinyLM, trainer

    model = TinyLM(cache, mode, loader_cls=CountingLoader)
    t = trainer(str(out), **kw)
    t.fit(model, ckpt_path=ckpt)
    model.handed = t.train_dataloader.handed
    return model


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["serial", "async", "workers"])
def test_resume_from_mid_epoch_checkpoints_is_exact(cache, tmp_path, mode):
    from lightning_job import weights

    # 6 optimizer steps of 2 micro-batches: 12 batches, two of the loader's epochs (one and a half with packing).
    full = fit(cache, tmp_path / "full", mode, max_steps=6, every=2)
    seen, states = plain(cache, mode, 12)
    assert len(set(seen)) == 12  # distinct batches: a skip cannot hide
    assert full.seen == seen  # what training_step received is the loader's stream, none skipped
    for step in (2, 4):
        ckpt = str(tmp_path / "full" / f"step={step}.ckpt")
        # The checkpoint holds the state after the 2*step micro-batches trained on, not after the one fetched ahead.
        assert stored_state(ckpt) == [states[2 * step - 1]]
        resumed = fit(cache, tmp_path / f"resumed{step}", mode, ckpt=ckpt, max_steps=6, every=2)
        assert resumed.seen == full.seen[2 * step:]
        assert resumed.losses == full.losses[2 * step:]
        assert weights(resumed) == weights(full)
        assert resumed.handed <= len(resumed.seen) + 1  # O(1): no replay, one batch of Lightning's look-ahead


def test_lightning_epochs_cut_by_limit_train_batches_resume_exactly(cache, tmp_path):
    from lightning_job import weights

    # Lightning epochs of 5 micro-batches (accumulation 2: steps after batches 2, 4, 5), counted by Lightning
    # as usual; checkpoints at an epoch's end and inside the next one.
    kw = dict(max_steps=7, every=1, limit_train_batches=5)
    full = fit(cache, tmp_path / "full", "async", **kw)
    assert full.seen == plain(cache, "async", 12)[0]  # no batch dropped at the ends
    assert len(full.seen) == 12  # two Lightning epoch ends crossed (after batches 5 and 10)
    for step in (3, 4):  # at the end of Lightning's first epoch, and one step into the next
        resumed = fit(cache, tmp_path / f"resumed{step}", "async", ckpt=str(tmp_path / "full" / f"step={step}.ckpt"), **kw)
        done = {3: 5, 4: 7}[step]
        assert resumed.seen == full.seen[done:]
        assert resumed.losses == full.losses[done:]
        assert weights(resumed) == weights(full)


@pytest.mark.parametrize("wiring", ["train_dataloaders", "datamodule"])
def test_every_documented_wiring_is_tracked(cache, tmp_path, wiring):
    from lightning_job import DataModule, Module, make_loader, trainer

    model = Module(cache, "serial")
    t = trainer(str(tmp_path), max_steps=3, every=2, accum=1)
    if wiring == "datamodule":
        t.fit(model, datamodule=DataModule(cache))
    else:
        t.fit(model, train_dataloaders=TorchLoader(make_loader(cache, "serial"), async_collation=False))
    seen, states = plain(cache, "serial", 3)
    assert model.seen == seen
    assert stored_state(str(tmp_path / "step=2.ckpt")) == [states[1]]
    assert t.train_dataloader.state_dict() == states[2]  # after fit: the last batch trained on, look-ahead dropped


def test_plain_torchloader_is_refused_at_fit_start(cache, tmp_path):
    from lightning_job import Module, make_loader, trainer

    model = Module(cache, "serial")
    tl = TorchLoader(make_loader(cache, "serial"), async_collation=False)
    with pytest.raises(RuntimeError, match=r"Trainer\(callbacks=\[portable_loader\.adapters\.lightning\.ExactResume\(\)"):
        trainer(str(tmp_path), max_steps=4, every=2, resume=False).fit(model, train_dataloaders=tl)
    assert model.seen == [] and not glob.glob(str(tmp_path / "*.ckpt"))
    # Once the line is added, the same loader trains from its first batch.
    trainer(str(tmp_path), max_steps=2, every=2, accum=1).fit(model, train_dataloaders=tl)
    assert model.seen == plain(cache, "serial", 2)[0]
    tl.close()
    # A validation TorchLoader needs nothing: Lightning reads it start to end and never checkpoints it.
    with TorchLoader(make_loader(cache, "serial"), async_collation=False) as val:
        from lightning.pytorch.utilities.combined_loader import CombinedLoader

        assert len(list(zip(range(3), CombinedLoader(val, "sequential")))) == 3


@pytest.mark.slow
def test_ddp_on_cpu_every_rank_resumes_its_slice(cache, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=path)
    job = [sys.executable, os.path.join(HERE, "lightning_job.py"), cache, str(tmp_path / "ckpt")]

    def run(result, *ckpt):
        done = subprocess.run([*job, str(tmp_path / result), *ckpt], env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.load(open(tmp_path / f"{result}-rank{r}.json")) for r in range(2)]

    full = run("full")
    resumed = run("resumed", str(tmp_path / "ckpt" / "step=2.ckpt"))
    for rank in range(2):
        # Global batch 8: each rank trains on its half of the single-process stream.
        assert full[rank]["seen"] == plain(cache, "async", 8, global_batch_size=8, shard=rank)[0]
        assert resumed[rank]["seen"] == full[rank]["seen"][4:]
        assert resumed[rank]["losses"] == full[rank]["losses"][4:]
        assert resumed[rank]["weights"] == full[rank]["weights"]
    assert full[0]["weights"] == full[1]["weights"]  # DDP kept the replicas equal
    # A loader built before the process group would feed both ranks the same rows: fit refuses it.
    for rank in range(2):
        assert "Create it inside train_dataloader()" in (tmp_path / f"resumed-rank{rank}-early.txt").read_text()


# --- Hugging Face Accelerate: register_for_checkpointing + save_state/load_state, as its users write it.
# No look-ahead there (the loop calls next itself, and prepare() leaves a TorchLoader alone), so the
# loader's own state_dict() is the right one: this checks that rather than assuming it.


def accelerate_run(cache, mode, out, *, resume=None, start=0, steps=6, accum=2):
    from accelerate import Accelerator
    from lightning_job import MODES, TinyLM, make_loader

    acc = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    model = TinyLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tl = TorchLoader(make_loader(cache, mode), **MODES[mode]["torch"])
    model, opt, prepared = acc.prepare(model, opt, tl)
    assert prepared is tl
    acc.register_for_checkpointing(tl)
    if resume:
        acc.load_state(resume)
    step = start
    with tl:
        for batch in tl:
            with acc.accumulate(model):
                acc.backward(model.training_step(batch, step))
                opt.step()
                opt.zero_grad()
            if acc.sync_gradients:
                step += 1
                acc.save_state(str(out / f"step{step}"))
                if step == steps:
                    break
    return acc.unwrap_model(model)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["serial", "async", "workers"])
def test_accelerate_save_state_load_state_resumes_exactly(cache, tmp_path, mode):
    from lightning_job import weights

    pytest.importorskip("accelerate")
    full = accelerate_run(cache, mode, tmp_path / "full")
    assert full.seen == plain(cache, mode, 12)[0]
    for step in (2, 4):  # mid loader epoch, and in the second loader epoch
        resumed = accelerate_run(cache, mode, tmp_path / f"r{step}", resume=str(tmp_path / "full" / f"step{step}"), start=step)
        assert resumed.seen == full.seen[2 * step:]
        assert resumed.losses == full.losses[2 * step:]
        assert weights(resumed) == weights(full)
