"""The chunked delta rule against the token-by-token recurrence, including the intermediate
states it emits at cut points for prefix-cache checkpoints (fresh random inputs, fp32)."""
import pytest
import torch

from freetoken.model.deltanet import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_step


def inputs(t, hv, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = l2norm(r(t, hv, dk)) * dk ** -0.5
    k = l2norm(r(t, hv, dk))
    v = r(t, hv, dv)
    g = -torch.nn.functional.softplus(r(t, hv))  # log-decay <= 0
    beta = torch.sigmoid(r(t, hv))
    state = r(hv, dk, dv) * 0.1
    return q, k, v, g, beta, state


def recurrence(q, k, v, g, beta, state):
    """Reference: one token at a time; returns outputs and the state after every token."""
    outs, states = [], []
    s = state[None]
    for i in range(q.shape[0]):
        o, s = recurrent_gated_delta_step(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], s)
        outs.append(o[0])
        states.append(s[0])
    return torch.stack(outs), states


@pytest.mark.parametrize("t,cuts", [(150, []), (150, [150]), (150, [1, 63, 64, 65, 149]),
                                    (200, [17, 40, 128, 199, 200]), (5, [2, 3])])
def test_chunked_rule_with_cuts_matches_recurrence(t, cuts):
    q, k, v, g, beta, state = inputs(t, 4, 16, 8, seed=t + len(cuts))
    out, final, snaps = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=64, cuts=cuts)
    ref_out, ref_states = recurrence(q, k, v, g, beta, state)
    tol = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    assert out.shape == ref_out.shape
    assert tol(out, ref_out) < 1e-4
    assert tol(final, ref_states[-1]) < 1e-4
    assert len(snaps) == len(cuts)
    for c, s in zip(cuts, snaps):
        assert tol(s, ref_states[c - 1]) < 1e-4, f"state after {c} tokens"


def test_cuts_do_not_change_outputs():
    """Splitting at cuts pads the sequence; the outputs must be the same as without cuts."""
    q, k, v, g, beta, state = inputs(300, 2, 8, 8, seed=7)
    a, fa, _ = chunk_gated_delta_rule(q, k, v, g, beta, state)
    b, fb, _ = chunk_gated_delta_rule(q, k, v, g, beta, state, cuts=[10, 70, 71, 250])
    assert float((a - b).abs().max()) < 1e-5 * float(a.abs().max())
    assert float((fa - fb).abs().max()) < 1e-5 * float(fa.abs().max())
