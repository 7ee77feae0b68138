"""Driving a ServingEngine in the test's own thread: requests join at given steps."""


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
