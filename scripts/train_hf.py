"""Train a tiny Llama with a stock transformers Trainer fed by portable_loader; resume in O(1).

    python scripts/train_hf.py --out ref --max-steps 30                        # uninterrupted
    python scripts/train_hf.py --out run --max-steps 30 --stop-after 20        # "preempted" after step 20
    python scripts/train_hf.py --out run --max-steps 30 --resume               # continues from checkpoint-20

The model is built from a config (no weights to download); batches are packed from the bundled
sample, with ``hf_labels=True`` (labels, attention_mask, per-document position_ids). On resume the
Trainer skips no batch and replays none: the loader restores its own state from the checkpoint.
"""

from __future__ import annotations

import argparse
import sys

import torch
import transformers

import portable_loader as pl
from portable_loader.adapters.hf import PortableTrainer
from portable_loader.adapters.torch import TorchLoader
from portable_loader.precache import sample_args


class _StopAfter(transformers.TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_save = True
            control.should_training_stop = True
        return control


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="hf_run")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --out")
    p.add_argument("--stop-after", type=int, help="stop after this step, as a preemption would")
    p.add_argument("--cache-dir", default="portable_loader_cache")
    args = p.parse_args(argv)

    cache = pl.precache(**sample_args(), out=args.cache_dir)
    loader = pl.DataLoader(pl.open_cache(cache), global_batch_size=8, seq_len=128, seed=0, packing=True)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config)
    training = transformers.TrainingArguments(
        output_dir=args.out, max_steps=args.max_steps, save_steps=args.save_steps, logging_steps=5,
        gradient_accumulation_steps=args.grad_accum, learning_rate=3e-3, report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True,
    )
    with TorchLoader(loader, hf_labels=True) as tl:
        trainer = PortableTrainer(model=model, args=training, train_loader=tl)
        if args.stop_after:
            trainer.add_callback(_StopAfter(args.stop_after))
        trainer.train(resume_from_checkpoint=True if args.resume else None)
    for h in trainer.state.log_history:
        if "loss" in h:
            print(f"step {h['step']:>4}  loss {h['loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
