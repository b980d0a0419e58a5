"""A run_clm.py-style script as Hugging Face's examples write it, with nothing of zerompi in
it: HfArgumentParser, `from transformers import Trainer`, resume from the last checkpoint,
save_model, evaluate. A tiny GPT-2 is built from a config (no download) and the data are
fixed-length blocks of random tokens, as run_clm's group_texts makes them.

    mpiexec -n 2 python -m zerompi.integrations.transformers run_clm_style.py \
        --output_dir out --do_train --do_eval --max_steps 4 --deepspeed ds_config.json --use_cpu
"""
import json
import math
import os
from dataclasses import dataclass

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments,
                          default_data_collator, set_seed)
from transformers.trainer_utils import get_last_checkpoint


@dataclass
class ModelArguments:
    n_layer: int = 2
    n_embd: int = 16
    block_size: int = 16
    train_samples: int = 32
    eval_samples: int = 8


def blocks(n, size, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, size), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def main():
    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    model_args, training_args = parser.parse_args_into_dataclasses()
    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
    set_seed(training_args.seed)
    config = GPT2Config(vocab_size=64, n_positions=model_args.block_size, n_embd=model_args.n_embd,
                        n_layer=model_args.n_layer, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    trainer = Trainer(model=model, args=training_args,
                      train_dataset=blocks(model_args.train_samples, model_args.block_size, 1),
                      eval_dataset=blocks(model_args.eval_samples, model_args.block_size, 2),
                      data_collator=default_data_collator)
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=last_checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if trainer.is_world_process_zero():
        with open(os.path.join(training_args.output_dir, "trainer_class.json"), "w") as f:
            json.dump({"class": type(trainer).__name__, "resumed_from": last_checkpoint}, f)


if __name__ == "__main__":
    main()
