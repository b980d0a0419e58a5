"""The engine's user API at one rank, in-process (issue 42): whatever the model returns
reaches engine.backward (zero/outputs.py), DeepSpeed's accessors, zerompi.initialize's two
return forms and its argument checks (integrations/initialize.py), and the loader that
gives each data-parallel rank its share and resumes (integrations/data.py). The multi-rank
side: tests/multirank/test_user_api_ranks.py."""
import pytest
import torch

import zerompi
from zerompi.integrations.data import ShardedLoader
from zerompi.models.gpt import GPT
from zerompi.models.gpt_config import GPTConfig
from zerompi.zero.outputs import find_loss

DS = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
      "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))


def _xy(b=2, t=8):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (b, t), generator=g), torch.randint(0, 32, (b, t), generator=g)


def test_find_loss_rules():
    loss = torch.tensor(2.0, requires_grad=True)
    logits = torch.zeros(2, 3)
    assert find_loss(loss) is loss
    assert find_loss((logits, loss)) is loss            # the package GPT
    assert find_loss((loss, logits, None)) is loss      # transformers, return_dict=False
    assert find_loss({"loss": loss, "logits": logits}) is loss
    from transformers.modeling_outputs import CausalLMOutput

    assert find_loss(CausalLMOutput(loss=loss, logits=logits)) is loss
    with pytest.raises(ValueError, match="loss=None"):
        find_loss(CausalLMOutput(logits=logits))
    with pytest.raises(ValueError, match="no one-element floating-point tensor"):
        find_loss((logits, torch.tensor([1, 2])))
    with pytest.raises(ValueError, match="scalar loss"):
        find_loss(logits)
    with pytest.raises(TypeError, match="got str"):
        find_loss("loss")


def test_engine_takes_gpt_tuple_and_transformers_output():
    """engine(x, y) -> (logits, loss) and a ModelOutput both go to backward as returned,
    and train: the update equals the one from passing the loss tensor itself."""
    x, y = _xy()
    a = zerompi.initialize(_gpt(), {"stage": 2})
    b = zerompi.initialize(_gpt(), {"stage": 2})
    a.backward(a(x, y))
    a.step()
    b.backward(b(x, y)[1])
    b.step()
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], p.float()) for k, p in _gpt().named_parameters())

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    eng = zerompi.initialize(hf, {"stage": 3, "gradient_accumulation_steps": 2})
    out = eng(input_ids=x, labels=x)
    assert out.loss is not None and out.logits.shape == (2, 8, 32)
    assert not eng.is_gradient_accumulation_boundary()
    eng.backward(out)
    assert eng.step() is False
    eng.backward(eng(input_ids=x, labels=x))
    assert eng.is_gradient_accumulation_boundary()
    assert eng.step() is True and eng.global_steps == 1
    assert eng.device == torch.device("cpu") and eng.dims.dp_size == 1 and eng.local_rank == 0
    assert eng.get_lr() == [eng.config.optimizer.lr]


def test_initialize_returns_the_engine_or_deepspeeds_tuple():
    eng = zerompi.initialize(_gpt(), {"stage": 1})
    assert isinstance(eng, zerompi.zero.engine.ZeroEngine)
    model = _gpt()
    out = zerompi.initialize(model=model, model_parameters=model.parameters(), config=DS, dist_init_required=False)
    assert isinstance(out, tuple) and len(out) == 4
    engine, opt, loader, sched = out
    assert opt is engine.optimizer and loader is None and sched is None
    assert engine.config.stage == 1 and engine.gradient_accumulation_steps == 2
    # explicit None counts as passed: still the DeepSpeed form
    model = _gpt()
    assert len(zerompi.initialize(model, DS, training_data=None, dist_init_required=False)) == 4


def test_initialize_argument_checks(tmp_path):
    model = _gpt()
    with pytest.raises(ValueError, match=r"leaves out 2 trainable parameter\(s\) \(ln_f.weight, ln_f.bias\)"):
        zerompi.initialize(model=model, model_parameters=[p for n, p in model.named_parameters()
                                                          if not n.startswith("ln_f")],
                           config={"stage": 1}, dist_init_required=False)
    # with an optimizer (zero/client_optim.py), model_parameters go to its factory unchecked here
    engine, opt, _, sched = zerompi.initialize(model=model, model_parameters=model.parameters(),
                                               optimizer=torch.optim.AdamW, config={"stage": 1},
                                               dist_init_required=False)
    assert opt is engine.optimizer and sched is None
    with pytest.raises(NotImplementedError, match="mpu= is not supported"):
        zerompi.initialize(model=model, mpu=object(), config={"stage": 1})
    with pytest.raises(ValueError, match="training_data needs the micro-batch size"):
        zerompi.initialize(model=model, training_data=list(range(8)), config={"stage": 1},
                           dist_init_required=False)

    class Args:
        deepspeed_config = str(tmp_path / "ds.json")

    (tmp_path / "ds.json").write_text('{"train_batch_size": 4, "zero_optimization": {"stage": 2}}')
    with pytest.raises(TypeError, match="both in args.deepspeed_config"):
        zerompi.initialize(args=Args(), model=model, config=DS)
    engine, _, loader, _ = zerompi.initialize(args=Args(), model=model, training_data=list(range(10)),
                                              dist_init_required=False)
    assert engine.config.stage == 2 and loader.batch_size == 4 and len(loader) == 3


def test_param_groups_from_model_parameters():
    model = _gpt()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    engine, *_ = zerompi.initialize(model=model, config={"stage": 2}, dist_init_required=False,
                                    model_parameters=[{"params": decay, "weight_decay": 0.1},
                                                      {"params": rest, "weight_decay": 0.0}])
    assert [g["weight_decay"] for g in engine.param_groups] == [0.1, 0.0]  # the empty default group hidden


def _taken(loaders, batches=None):
    out = []
    for ld in loaders:
        got = []
        for i, b in enumerate(ld):
            got += b.tolist()
            if batches is not None and i + 1 == batches:
                break
        out.append(got)
    return out


@pytest.mark.parametrize("drop_last", [False, True])
def test_loader_shares_match_distributed_sampler(drop_last):
    ds = list(range(23))
    for n in (1, 2, 3, 4):
        loaders = [ShardedLoader(ds, 2, dp_rank=r, dp_size=n, seed=5, drop_last=drop_last) for r in range(n)]
        for epoch in range(2):
            want = [list(torch.utils.data.DistributedSampler(ds, num_replicas=n, rank=r, seed=5,
                                                             drop_last=drop_last).__iter__())
                    for r in range(n)] if epoch == 0 else None
            got = _taken(loaders)
            if want is not None:
                assert got == want
            assert len({len(g) for g in got}) == 1  # every rank as many samples (batches)
            assert len(loaders[0]) == -(-len(got[0]) // 2)
        assert got != _taken([ShardedLoader(ds, 2, dp_rank=r, dp_size=n, seed=5, drop_last=drop_last)
                              for r in range(n)]) or n == 1 and drop_last  # epoch 1 reshuffled


@pytest.mark.parametrize("n_new", [2, 3])
def test_loader_resumes_where_the_checkpoint_was_taken(n_new):
    """Two ranks take 2 batches of 3, the position is saved; the rest of the epoch, at 2
    ranks or 3, is exactly the samples not yet taken, in the epoch's order."""
    ds = list(range(20))
    first = [ShardedLoader(ds, 3, dp_rank=r, dp_size=2, seed=1) for r in range(2)]
    head = _taken(first, batches=2)
    state = first[0].state_dict()
    assert state["samples"] == 12 and state["epoch"] == 0
    full = [ShardedLoader(ds, 3, dp_rank=r, dp_size=2, seed=1) for r in range(2)]
    order = [i for pair in zip(*_taken(full)) for i in pair]  # the epoch's global order
    resumed = [ShardedLoader(ds, 3, dp_rank=r, dp_size=n_new, seed=1) for r in range(n_new)]
    for ld in resumed:
        ld.load_state_dict(state)
    tail = _taken(resumed)
    assert sorted(head[0] + head[1]) == sorted(order[:12])
    taken = [i for t in tail for i in t]
    pad = -8 % n_new  # the new ranks' share is padded from the epoch's start, as DistributedSampler's
    assert sorted(taken) == sorted(order[12:20] + order[:pad])
    assert [t[0] for t in tail] == order[12:12 + n_new]
    assert all(ld.epoch == 1 and ld.samples == 0 for ld in resumed)
    with pytest.raises(ValueError, match="dataset of 20 samples, this one has 19"):
        ShardedLoader(ds[:19], 3, dp_rank=0, dp_size=1).load_state_dict(state)


def test_loader_position_rides_in_the_engines_checkpoint(tmp_path):
    model = _gpt()
    engine, _, loader, _ = zerompi.initialize(model=model, model_parameters=model.parameters(), config=DS,
                                              training_data=list(range(12)), dist_init_required=False)
    it = iter(loader)
    next(it)
    engine.save_checkpoint(tmp_path, client_state={"mine": 1})
    model2 = _gpt()
    engine2, _, loader2, _ = zerompi.initialize(model=model2, model_parameters=model2.parameters(), config=DS,
                                                training_data=list(range(12)), dist_init_required=False)
    assert engine2.load_checkpoint(tmp_path) == {"mine": 1}
    assert (loader2.epoch, loader2.samples) == (0, 3)
    assert _taken([loader2]) == [list(next(it).tolist()) + sum((b.tolist() for b in it), [])]


def test_deepspeed_scheduler_block_comes_back_as_the_tuples_scheduler():
    """A DeepSpeedExamples config with a scheduler block: the 4-tuple's scheduler is the
    engine's (built by zero/client_optim.py from the block, stepped by the engine)."""
    model = _gpt()
    ds = dict(DS, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}})
    engine, opt, _, sched = zerompi.initialize(model=model, model_parameters=model.parameters(), config=ds,
                                               dist_init_required=False)
    assert sched is not None and sched is engine.lr_scheduler and opt is engine.optimizer


def test_a_save_between_micro_steps_is_refused(tmp_path):
    # the accumulated gradients are not in a checkpoint: a save there would resume differently
    torch.manual_seed(0)
    eng = zerompi.initialize(torch.nn.Linear(4, 2), {"stage": 1, "gradient_accumulation_steps": 2})
    x = torch.randn(3, 4)
    eng.backward(eng(x).square().mean())
    eng.step()
    with pytest.raises(ValueError, match="after micro-step 1 of 2 of an update"):
        eng.save_checkpoint(tmp_path / "mid")
    eng.backward(eng(x).square().mean())
    eng.step()
    assert eng.save_checkpoint(tmp_path / "boundary")
