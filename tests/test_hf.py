"""PortableTrainer: a real transformers.Trainer on CPU resumes from a checkpoint with the batches and
losses of an uninterrupted run (across loader epochs, with gradient accumulation), in O(1)."""

import functools
import hashlib
import importlib.util
import json

import pytest

import portable_loader as pl
from conftest import SAMPLE
from portable_loader.adapters.hf import state_file
from portable_loader.adapters.torch import TorchLoader

# Skipped where the hf extra is missing, as pytest.importorskip would; without importing transformers'
# Trainer here, where every test process collects this module (seconds), only where a test runs.
pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("transformers", "accelerate")),
                                reason="needs transformers and accelerate (the hf extra)")


@functools.cache
def recording() -> type:
    """A PortableTrainer that records a digest of every batch the model is trained on, and how many
    batches the loader had produced before the first training step."""
    from portable_loader.adapters.hf import PortableTrainer

    class Recording(PortableTrainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.seen, self.fetched_before_first_step = [], None
            original = self.train_loader.__class__.__next__
            loader = self.train_loader
            self.fetched = 0

            def counting_next(tl):
                self.fetched += 1
                return original(tl)

            loader.__class__ = type("CountingTorchLoader", (loader.__class__,), {"__next__": counting_next})

        def compute_loss(self, model, inputs, *args, **kwargs):
            if self.fetched_before_first_step is None:
                self.fetched_before_first_step = self.fetched
            self.seen.append(hashlib.sha256(b"".join(inputs[k].cpu().numpy().tobytes() for k in sorted(inputs))).hexdigest())
            return super().compute_loss(model, inputs, *args, **kwargs)

    return Recording


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # 40 records, 4 per batch: a loader epoch every 10 batches, crossed several times below.
    return pl.precache(str(SAMPLE / "sample_chat.jsonl"), tokenizer=str(SAMPLE / "tokenizer"), format="chat",
                       out=str(tmp_path_factory.mktemp("c")), split="train[:40]")


def make_trainer(cache, out, max_steps=12, accum=2, async_collation=True):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    loader = pl.DataLoader(pl.open_cache(cache), global_batch_size=4, seq_len=64, seed=1, packing=False)
    tl = TorchLoader(loader, hf_labels=True, async_collation=async_collation)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, save_steps=4, gradient_accumulation_steps=accum, learning_rate=1e-2,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, save_only_model=False,
        disable_tqdm=True,
    )
    return recording()(model=model, args=args, train_loader=tl)


def losses(trainer):
    return [round(h["loss"], 6) for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_resume_sees_the_same_batches_and_losses(cache, tmp_path, accum):
    full = make_trainer(cache, tmp_path / "full", accum=accum)
    full.train()
    assert len(full.seen) == 12 * accum
    for ckpt in (4, 8):
        resumed = make_trainer(cache, tmp_path / "full", accum=accum)
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{ckpt}"))
        assert resumed.seen == full.seen[ckpt * accum :]  # byte-identical batches, none skipped or repeated
        assert losses(resumed)[-(12 - ckpt):] == losses(full)[ckpt:]
        # O(1): the loader produced only the batches of the first step before training, at any checkpoint.
        assert resumed.fetched_before_first_step == accum
        resumed.train_loader.close()
    full.train_loader.close()


@pytest.mark.slow
def test_resume_from_checkpoint_true_picks_the_latest_and_state_is_of_consumed_batches(cache, tmp_path):
    first = make_trainer(cache, tmp_path / "run", max_steps=8)
    first.train()
    with open(state_file(str(tmp_path / "run" / "checkpoint-8"), rank=0)) as f:
        saved = json.loads(json.load(f)["portable_loader"])
    # 8 optimizer steps x 2 accumulated batches; the batch the async collator had prepared is not in it.
    assert saved["step"] == 16
    reference = make_trainer(cache, tmp_path / "ref", max_steps=12)
    reference.train()
    longer = make_trainer(cache, tmp_path / "run", max_steps=12)
    longer.train(resume_from_checkpoint=True)  # the latest: checkpoint-8
    assert longer.seen == reference.seen[16:]
    with pytest.raises(ValueError, match="no checkpoint found"):
        make_trainer(cache, tmp_path / "empty").train(resume_from_checkpoint=True)
    for t in (first, reference, longer):
        t.train_loader.close()


def test_max_steps_is_required(cache, tmp_path):
    with pytest.raises(ValueError, match="max_steps"):
        make_trainer(cache, tmp_path / "x", max_steps=-1)
