"""Metrics from the training step itself (``metrics_fn=``, ``step.last_metrics``): a training accuracy from the
step's logits, auxiliary losses and the logits, equal to what an eager loop reads after its forward (bit for bit at
world size 1), each rank's own on several ranks, and kept values unchanged by the steps after them."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocc
from tests import distributed


class MultiTask(nn.Module):
    """A model returning a dict: the loss, the logits and a component loss (a router's auxiliary loss)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.side = nn.Linear(16, 1)

    def forward(self, x, y):
        hidden = torch.relu(self.body(x))
        logits = self.head(hidden)
        aux = self.side(hidden).pow(2).mean()
        return {"loss": F.cross_entropy(logits, y) + 0.1 * aux, "logits": logits, "aux": aux}


def metrics(output, x, y):
    return {"accuracy": (output["logits"].argmax(-1) == y).float().mean(), "logits": output["logits"],
            "aux": output["aux"]}


def batch(i, size=8):
    generator = torch.Generator().manual_seed(i)
    return torch.randn(size, 8, generator=generator), torch.randint(0, 4, (size,), generator=generator)


def model_and_optimizer():
    torch.manual_seed(0)
    model = MultiTask()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def eager(steps, accumulation):
    """The eager loop: metrics read after each micro-batch's forward, stacked over micro-batches."""
    model, optimizer = model_and_optimizer()
    losses, read = [], []
    for i in range(steps):
        x, y = batch(i)
        total, per = None, []
        for xs, ys in zip(x.chunk(accumulation), y.chunk(accumulation)):
            output = model(xs, ys)
            loss = output["loss"] / accumulation if accumulation > 1 else output["loss"]
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
            with torch.no_grad():
                per.append({k: v.detach().clone() for k, v in metrics(output, xs, ys).items()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
        read.append(per[0] if accumulation == 1 else {k: torch.stack([p[k] for p in per]) for k in per[0]})
    return losses, read, model.state_dict()


@pytest.mark.parametrize("stage, accumulation, pools", [(0, 1, True), (3, 1, False), (1, 2, True), (3, 2, True)])
def test_metrics_of_the_step_equal_eager_and_stay_as_read(stage, accumulation, pools):
    expected_losses, expected, expected_state = eager(3, accumulation)
    model, optimizer = model_and_optimizer()
    step = zerocc.compile(model, optimizer, stage=stage, grad_accumulation=accumulation, memory_pools=pools,
                          metrics_fn=metrics, progress=False)
    assert step.last_metrics == {}
    losses, kept, copies = [], [], []
    for i in range(3):
        losses.append(step(*batch(i)))
        kept.append(step.last_metrics)
        copies.append({k: v.clone() for k, v in kept[-1].items()})
    for got, copy, want in zip(kept, copies, expected):
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(copy[name], want[name]), name
            assert torch.equal(got[name], copy[name]), f"{name} kept from an earlier step changed"
    assert all(torch.equal(a, b) for a, b in zip(losses, expected_losses))
    state = step.full_state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected_state.items())


def test_a_parameter_read_as_a_metric_is_its_value_before_the_update():
    """A metric that is a parameter (a learned temperature) is the value forward used, as eager reads it before
    ``optimizer.step()``, and stays so: the update does not write into a tensor the step returned."""
    def read_weight(output, x, y):
        return {"w": model.head.weight, "w00": model.head.weight[0, 0]}

    model, optimizer = model_and_optimizer()
    expected = []
    for i in range(2):
        output = model(*batch(i))
        output["loss"].backward()
        expected.append({k: v.detach().clone() for k, v in read_weight(output, *batch(i)).items()})
        optimizer.step()
        optimizer.zero_grad()
    model, optimizer = model_and_optimizer()
    step = zerocc.compile(model, optimizer, stage=0, metrics_fn=read_weight, progress=False)
    kept = []
    for i in range(2):
        step(*batch(i))
        kept.append(step.last_metrics)
    for got, want in zip(kept, expected):
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["w00"], want["w00"])
    assert not torch.equal(kept[0]["w"], kept[1]["w"])


def test_metrics_fn_that_cannot_be_used_is_refused_naming_it():
    x, y = batch(0)
    for bad, says in [(lambda output, x, y: output["aux"], "not a dict of tensors"),
                      (lambda output, x, y: {"acc": 0.5}, "'acc' (float), not a tensor"),
                      (lambda output, x: {"aux": output["aux"]}, "cannot be called as metrics_fn(output, arg0, arg1)")]:
        model, optimizer = model_and_optimizer()
        step = zerocc.compile(model, optimizer, stage=0, metrics_fn=bad, progress=False)
        with pytest.raises(zerocc.CaptureError, match="metrics_fn \\(.*test_metrics.py:\\d+\\)") as error:
            step(x, y)
        assert says in str(error.value)
    with pytest.raises(zerocc.ConfigError, match="metrics_fn must be callable"):
        zerocc.compile(*model_and_optimizer(), metrics_fn={"acc": 1})


def test_a_loss_fn_returning_metrics_points_to_metrics_fn():
    net = nn.Linear(8, 4)

    def loss_and_accuracy(output, y):
        return F.cross_entropy(output, y), (output.argmax(-1) == y).float().mean()

    step = zerocc.compile(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=0, loss_fn=loss_and_accuracy,
                          progress=False)
    with pytest.raises(zerocc.CaptureError, match="metrics_fn="):
        step(*batch(0))


def _metrics_per_rank(rank, world_size):
    model, optimizer = model_and_optimizer()
    reference, reference_optimizer = model_and_optimizer()
    step = zerocc.compile(model, optimizer, stage=3, grad_accumulation=2, metrics_fn=metrics, progress=False)
    got, expected = [], []
    for i in range(2):
        x, y = batch(i, 16)
        mine = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        step(*mine)
        got.append(step.last_metrics)
        with torch.no_grad():   # this rank's micro-batches on the weights before the step, as the step read them
            per = [metrics(reference(xs, ys), xs, ys) for xs, ys in zip(mine[0].chunk(2), mine[1].chunk(2))]
        expected.append({k: torch.stack([p[k] for p in per]) for k in per[0]})
        reference(x, y)["loss"].backward()   # the global batch: the mean over equal slices and micro-batches
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    return got, expected


@pytest.mark.multirank
def test_each_rank_has_the_metrics_of_its_own_slice():
    for got, expected in distributed.run(_metrics_per_rank, 2):
        for g, e in zip(got, expected):
            for name in e:
                torch.testing.assert_close(g[name], e[name])


def test_a_model_returning_loss_and_logits_trains_and_its_logits_are_read_with_metrics_fn():
    """``return (loss, logits)``: the refusal names both keywords, and with them the step trains as eager and
    gives the logits of its own forward."""
    class LossAndLogits(MultiTask):
        def forward(self, x, y):
            output = super().forward(x, y)
            return output["loss"], output["logits"]

    torch.manual_seed(0)
    model = LossAndLogits()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=0, progress=False)
    with pytest.raises(zerocc.CaptureError, match=r"loss_fn=lambda output: output\[0\], num_targets=0, and metrics_fn="):
        step(*batch(0))
    _, expected, expected_state = eager(2, 1)
    torch.manual_seed(0)
    model = LossAndLogits()
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, loss_fn=lambda out: out[0],
                          num_targets=0, metrics_fn=lambda out, x, y: {"logits": out[1]}, progress=False)
    for i in range(2):
        step(*batch(i))
        assert torch.equal(step.last_metrics["logits"], expected[i]["logits"])
    state = step.full_state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected_state.items())


def test_a_running_statistic_read_as_a_metric_is_not_overwritten_by_the_next_step():
    """The running mean forward wrote is also the value the step writes back into its buffer's slot (in place
    where memory pools can): a kept one must stay the step's value, not follow the buffer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    norm = model[1]
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=0, memory_pools=True,
                          loss_fn=F.cross_entropy, metrics_fn=lambda output, x, y: {"mean": norm.running_mean},
                          progress=False)
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    kept, expected = [], []
    for i in range(3):
        step(*batch(i))
        kept.append(step.last_metrics["mean"])
        F.cross_entropy(reference(batch(i)[0]), batch(i)[1]).backward()
        expected.append(reference[1].running_mean.clone())
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    for got, want in zip(kept, expected):
        assert torch.equal(got, want)
