"""Driving a ServingEngine in the test's own thread: requests join at given steps; an engine's
routed experts moved onto the torch path."""


def drive(srv, reqs, arrive=None, max_steps: int = 10_000):
    """Step `srv` until every request of `reqs` finished; request i joins at step arrive[i]
    (default: all at step 0). Returns reqs."""
    arrive = arrive or [0] * len(reqs)
    step = 0
    while any(r.finished_at is None for r in reqs):
        for r, at in zip(reqs, arrive):
            if at == step:
                srv.sched.add(r)
        srv.step()
        step += 1
        assert step < max_steps, "the requests did not finish"
    return reqs


def torch_experts(eng):
    """The engine with its routed experts on the torch path (TorchExpertExecutor over the same
    banks, quantized or not): every expert resident, reentrant, as resident experts on a GPU."""
    from freetoken.experts.executor import TorchExpertExecutor
    from freetoken.model.moe import MoE
    old = eng.executor
    ex = TorchExpertExecutor(old.gate_up, old.down, layer_experts=eng.cfg.num_experts, activation=old.activation,
                             gate_up_bias=old.gate_up_bias, down_bias=old.down_bias)
    for _, mlp, _, _ in eng.model.layers:
        if isinstance(mlp, MoE):
            mlp.executor = ex
    eng.executor = ex
    return eng
