"""nebula.DiLoCo: a user's model and inner optimizer, trained across sites by the configured
strategy ([strategy] kind = "diloco" or "streaming", with its codec, outer optimizer, PEFT
selection, heterogeneous sites, update guard and differential privacy): the same C++ strategy
`nebula worker` runs (nebula::Synchronizer), on this process's parameters in place.

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt = nebula.DiLoCo(model, opt)           # the one changed line
    for step in range(steps):
        loss = loss_fn(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
    opt.finish()                               # completes what is still on the WAN

step() averages the gradients over the site's workers (its data-parallel group), runs the
inner optimizer, and every H steps the strategy's outer step across sites. Every replica of the
job starts from global rank 0's weights (the constructor copies them).
"""

import torch

from . import _nebula, metrics
from .session import session as _default_session


class DiLoCo:
    def __init__(self, model, optimizer, session=None):
        self.session = session or _default_session()
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        for i, p in enumerate(self.params):
            if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
                raise _nebula.Error(
                    f"nebula.DiLoCo: parameter {i} is {p.dtype} on {p.device} (contiguous: {p.is_contiguous()}); "
                    f"the strategies take contiguous float32 CPU parameters so far")
        optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not all(id(p) in optimized for p in self.params):
            raise _nebula.Error("nebula.DiLoCo: the optimizer does not update every trainable parameter of the model; "
                                "pass the optimizer built on model.parameters() (frozen ones: requires_grad=False)")
        buffers = [b for b in model.buffers() if b.dtype == torch.float32]
        self._sync = _nebula.Synchronizer(self.session, self.params, buffers)
        self.steps_done = 0
        metrics._process_strategy = self  # nebula.log's lines carry its counters

    # The optimizer's interface, so the loop changes in one line.
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=False):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, weight=1.0, loss=None):
        """After backward: the site's gradient average (each worker counting `weight`, e.g. its
        batch's examples), the inner optimizer's step, and the strategy's outer step when due.
        `loss` (this step's training loss, a number or a one-element tensor) is needed with
        [strategy] max_loss_penalty > 0: the controller watches quality from it."""
        if loss is not None:
            self._sync.observe_loss(float(loss))
        elif self._sync.watches_quality:
            raise _nebula.Error(
                f"nebula.DiLoCo: [strategy] max_loss_penalty in {self.session.config_path} makes the controller "
                f"watch quality from the training loss: pass it, opt.step(loss=loss)")
        if not self.keep_training():  # opens the strategy's round if the loop did not ask (idempotent)
            raise _nebula.Error(
                f"nebula.DiLoCo: step {self.steps_done} is past the job's last ({self.session.steps} steps, "
                f"[job] steps in {self.session.config_path}); with [strategy] heterogeneous = true a site's step "
                f"count follows its speed: loop `while opt.keep_training():`")
        self._sync.sync_gradients(weight)
        self.optimizer.step()
        self._sync.after_step(self.steps_done)
        self.steps_done += 1

    def keep_training(self, step=None, steps=None):
        """Whether to run step `step` (default: the next) of `steps` (default: job.steps). A loop
        `for step in range(job.steps)` needs no call (step() asks); with [strategy]
        heterogeneous = true, where a faster site runs more inner steps per round, loop
        `while opt.keep_training():`."""
        return self._sync.keep_training(self.steps_done if step is None else step,
                                        self.session.steps if steps is None else steps)

    def finish(self):
        """After the last step, on every worker: completes the exchanges still on the WAN."""
        self._sync.finish()

    @property
    def name(self):
        return self._sync.name

    def metrics(self):
        """The strategy's counters (outer steps, rejected updates, privacy spent, ...) and this
        worker's WAN bytes."""
        m = dict(self._sync.metrics())
        m["wan_bytes_sent"] = self.session.wan_bytes_sent
        m["wan_bytes_received"] = self.session.wan_bytes_received
        return m

    def decisions(self):
        return list(self._sync.decisions())

    def state_dict(self):
        """The inner optimizer's and the strategy's state (global weights and outer momentum of this
        worker's part, codec error feedback, counters). Save the model's own state_dict beside it.
        Waits for an exchange still on the WAN first."""
        if not self._sync.can_save():
            self._sync.drain()
        return {"inner": self.optimizer.state_dict(), "strategy": self._sync.state(), "steps_done": self.steps_done}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["inner"])
        self._sync.load_state(state["strategy"])
        self.steps_done = int(state["steps_done"])
