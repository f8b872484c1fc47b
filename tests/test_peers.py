"""The PyTorch peer of the train-step benchmark (benchmarks/peers/) computes our model's
function: with our parameters copied in and dropout off, the same logits and loss."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.config import resolve
from transformer.model import Transformer, shift_right

torch = pytest.importorskip("torch", reason='the PyTorch peer needs pip install -e ".[torch]"')
peer = pytest.importorskip("benchmarks.peers.torch_transformer")


def test_the_peer_computes_our_logits_and_loss(load_config):
    run = resolve(load_config("tiny.py"), 1)
    model_cfg = run.model
    rng = np.random.default_rng(0)
    inputs = rng.integers(3, model_cfg.vocab_size, (2, 7))
    targets = rng.integers(3, model_cfg.vocab_size, (2, 6))
    ours = Transformer(model_cfg)
    params = nn.unbox(ours.init(jax.random.key(0), jnp.asarray(inputs), jnp.asarray(targets)))
    logits = np.asarray(ours.apply(params, jnp.asarray(inputs), jnp.asarray(targets)))

    theirs = peer.Transformer(model_cfg).eval()
    peer.load_params(theirs, jax.tree.map(np.asarray, params["params"]))
    assert sum(p.numel() for p in theirs.parameters()) == sum(
        x.size for x in jax.tree.leaves(params))
    decoder_inputs = torch.from_numpy(np.asarray(shift_right(jnp.asarray(targets))))
    with torch.no_grad():
        their_logits = theirs(torch.from_numpy(inputs), decoder_inputs).numpy()
        loss = float(theirs.loss(torch.from_numpy(inputs), torch.from_numpy(targets), 0.1))
    np.testing.assert_allclose(their_logits, logits, atol=2e-5, rtol=1e-5)

    log_probs = jax.nn.log_softmax(logits)
    smoothed = 0.9 * np.take_along_axis(np.asarray(log_probs), targets[..., None], -1)[..., 0] \
        + 0.1 * np.asarray(log_probs).mean(-1)
    assert loss == pytest.approx(-smoothed.mean(), rel=1e-5)
