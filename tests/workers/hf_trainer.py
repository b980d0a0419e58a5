"""The Hugging Face Trainer on zerompi (tests/multirank/test_hf_trainer.py).

  ref DIR          one rank, plain transformers.Trainer (no zerompi): a tiny GPT-2 on 32
                   blocks of 16 tokens, global batch 8 as 4 x 2 accumulation, 1 epoch (4
                   updates), linear schedule with warm-up, clipping, weight decay, eval
                   every 2 steps; and the same with the batch as 2 x 4 (the noise floor)
  zero STAGES DIR  N ranks, ZeroTrainer at each stage of the comma list, the same global
                   batch (per_device_train_batch_size 8 / (2 N), accumulation 2), saving
                   checkpoint-2; then a fresh ZeroTrainer resumed from checkpoint-2; and
                   save_model's files read back with from_pretrained
  launcher DIR     N ranks, tests/data/scripts/run_clm_style.py (no zerompi in it) through
                   `python -m zerompi.integrations.transformers SCRIPT ... --deepspeed FILE`:
                   4 steps, then the same command with --max_steps 6 resumes from checkpoint-4
"""
import argparse
import json
import os
import warnings

import torch

warnings.filterwarnings("ignore")
import transformers as tf  # noqa: E402

tf.logging.set_verbosity_error()
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("mode")
ap.add_argument("rest", nargs="*")
a = ap.parse_args()

SEQ, N_SAMPLES, GLOBAL = 16, 32, 8


def model():
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg)


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, SEQ), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def args(out, per_device, gas, **kw):
    return tf.TrainingArguments(out, per_device_train_batch_size=per_device, per_device_eval_batch_size=2,
                                gradient_accumulation_steps=gas, num_train_epochs=1, learning_rate=1e-2,
                                warmup_steps=1, lr_scheduler_type="linear", weight_decay=0.1, max_grad_norm=0.5,
                                logging_steps=1, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                                save_steps=2, report_to="none", use_cpu=True, seed=0, disable_tqdm=True, **kw)


def history(trainer):
    h = trainer.state.log_history
    return {"loss": [e["loss"] for e in h if "loss" in e], "grad_norm": [e["grad_norm"] for e in h if "grad_norm" in e],
            "lr": [e["learning_rate"] for e in h if "learning_rate" in e],
            "eval_loss": [e["eval_loss"] for e in h if "eval_loss" in e]}


def params(m):
    return {n: p.detach().float().tolist() for n, p in m.named_parameters()}


def ref(d):
    out = {}
    for name, per_device, gas in (("ref", 4, 2), ("floor", 2, 4)):
        m = model()
        t = tf.Trainer(model=m, args=args(os.path.join(d, name), per_device, gas), train_dataset=data(N_SAMPLES, 1),
                       eval_dataset=data(8, 2))
        t.train()
        out[name] = {"history": history(t), "params": params(m)}
    return out


def zero(stage, d):
    import zerompi
    from zerompi.integrations.transformers import ZeroTrainer

    zerompi.init_process_group()  # before TrainingArguments: accelerate reads the group
    n = torch.distributed.get_world_size()
    per_device = GLOBAL // (2 * n)
    out_dir = os.path.join(d, "run")

    def trainer():
        return ZeroTrainer(model=model(), args=args(out_dir, per_device, 2), train_dataset=data(N_SAMPLES, 1),
                           eval_dataset=data(8, 2), zero_config={"stage": stage, "bucket_size": 500})

    t = trainer()
    t.train()
    full = t.engine.full_state_dict()
    t.save_model(os.path.join(d, "final"))
    res = {"history": history(t), "global_steps": t.engine.global_steps, "stage": t.engine.config.stage}
    r = trainer()
    r.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2"))
    again = r.engine.full_state_dict()
    res["resumed_history"] = history(r)
    if torch.distributed.get_rank() == 0:
        res["params"] = {k: v.tolist() for k, v in full.items()}
        res["resume_same"] = all(torch.equal(full[k], again[k]) for k in full)
        saved = tf.GPT2LMHeadModel.from_pretrained(os.path.join(d, "final"))
        res["saved_same"] = all(torch.equal(full[k], p.detach()) for k, p in saved.named_parameters())
        res["files"] = sorted(os.listdir(os.path.join(out_dir, "checkpoint-2")))
    return res


def launcher(d):
    import transformers
    from zerompi.integrations import transformers as zt

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "scripts", "run_clm_style.py")
    ds = os.path.join(d, "ds_config.json")
    if int(os.environ.get("PMI_RANK", "0")) == 0:
        with open(ds, "w") as f:  # the Hugging Face template's shape: "auto" where the Trainer decides
            json.dump({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                       "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
                       "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                       "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                                 "weight_decay": "auto"}}}, f)
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()  # the file is written before any rank reads it
    out = os.path.join(d, "out")
    runs = []
    original = transformers.Trainer
    try:
        for steps in (4, 6):
            zt.main([script, "--output_dir", out, "--do_train", "--do_eval", "--per_device_train_batch_size", "2",
                     "--gradient_accumulation_steps", "2", "--max_steps", str(steps), "--save_steps", "2",
                     "--learning_rate", "0.01", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
                     "--deepspeed", ds])
            torch.distributed.barrier()  # rank 0 wrote the files
            with open(os.path.join(out, "trainer_class.json")) as f:
                runs.append(json.load(f))
            with open(os.path.join(out, "trainer_state.json")) as f:
                runs[-1]["global_step"] = json.load(f)["global_step"]
            with open(os.path.join(out, "eval_results.json")) as f:
                runs[-1]["eval_loss"] = json.load(f)["eval_loss"]
    finally:
        transformers.Trainer = original
    engine_ckpt = os.path.join(out, "checkpoint-6", "zerompi")
    with open(os.path.join(engine_ckpt, open(os.path.join(engine_ckpt, "latest")).read().strip(), "manifest.json")) as f:
        stage = json.load(f)["stage"]
    return {"runs": runs, "stage": stage, "checkpoint": sorted(os.listdir(os.path.join(out, "checkpoint-6"))),
            "saved": sorted(os.listdir(out))}


if a.mode == "ref":
    result = ref(a.rest[0])
elif a.mode == "launcher":
    result = launcher(a.rest[0])
else:
    result = {f"stage{s}": zero(int(s), os.path.join(a.rest[1], f"stage{s}")) for s in a.rest[0].split(",")}
if int(os.environ.get("PMI_RANK", "0")) == 0:
    with open(a.out, "w") as f:
        json.dump(result, f)
