"""The PyTorch peer of the train-step benchmark (benchmarks/peers/) computes our model's
function: with our parameters copied in and dropout off, the same logits and loss."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.config import resolve
from transformer.model.transformer import Transformer, shift_right

torch = pytest.importorskip("torch", reason='the PyTorch peer needs pip install -e ".[torch]"')
peer = pytest.importorskip("benchmarks.peers.torch_transformer")


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_the_peer_computes_our_logits_and_loss(load_config, norm_position):
    run = resolve(load_config("tiny.py", **{"model.norm_position": norm_position}), 1)
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
    decoder_inputs = torch.from_numpy(np.array(shift_right(jnp.asarray(targets))))
    with torch.no_grad():
        their_logits = theirs(torch.from_numpy(inputs), decoder_inputs).numpy()
        loss = float(theirs.loss(torch.from_numpy(inputs), torch.from_numpy(targets), 0.1))
    np.testing.assert_allclose(their_logits, logits, atol=2e-5, rtol=1e-5)

    log_probs = jax.nn.log_softmax(logits)
    smoothed = 0.9 * np.take_along_axis(np.asarray(log_probs), targets[..., None], -1)[..., 0] \
        + 0.1 * np.asarray(log_probs).mean(-1)
    assert loss == pytest.approx(-smoothed.mean(), rel=1e-5)



def test_the_peer_refuses_a_block_it_does_not_compute(load_config):
    run = resolve(load_config("tiny.py", **{"model.positional": "rope"}), 1)
    with pytest.raises(ValueError, match="paper's block only, not model.positional='rope'"):
        peer.Transformer(run.model)


@pytest.fixture(scope="module", params=["post", "pre"])
def copy_model(tmp_path_factory, load_config, request):
    """configs/tiny.py (post-LN or pre-LN) trained for 100 updates on the copy task
    (test_train_translation's recipe): outputs that follow the source, half right, so searches
    have real choices."""
    from transformer.checkpoint import averaging, layout
    from transformer.data.synthetic import SyntheticTask
    from transformer.training.loop import train_and_evaluate

    task = SyntheticTask("copy", vocab_size=16, min_length=4, max_length=8, seed=0)
    cfg = load_config("tiny.py", **{
        "data.task": task.task, "data.vocab_size": task.vocab_size,
        "data.min_length": task.min_length, "data.max_length": task.max_length,
        "seed": task.seed, "num_train_steps": 100, "checkpoint_every_steps": 100,
        "eval_every_steps": 0, "log_every_steps": 100, "model.num_encoder_layers": 1,
        "model.num_decoder_layers": 1, "model.dropout_rate": 0.0, "label_smoothing": 0.0,
        "optimizer.learning_rate": 1e-2, "optimizer.warmup_steps": 10,
        "model.norm_position": request.param})
    workdir = str(tmp_path_factory.mktemp("copy"))
    train_and_evaluate(cfg, workdir)
    run = resolve(layout.load_config(workdir))
    sources = [list(map(int, task.example("test", i)[0])) for i in range(12)]
    return run, averaging.load_params(workdir), sources


@pytest.mark.parametrize("beam_size", [1, 4])
def test_the_peer_searches_our_tokens(copy_model, beam_size):
    """Greedy and beam search of the PyTorch peer (torch_search.py) with our parameters copied
    in: the same tokens as `Translator.translate_ids`, sources of unequal lengths padded."""
    from benchmarks.peers import torch_search
    from transformer.inference.translator import Translator

    run, params, sources = copy_model
    extra = 6  # a penalty strong enough to change hypotheses here (0.6 does not)
    alpha = 2.0
    expected = Translator(run.config, run.model, params, None).translate_ids(
        sources, beam_size=beam_size, alpha=alpha, max_extra_length=extra)
    assert len({tuple(row) for row in expected}) == len(sources)  # no degenerate outputs

    theirs = peer.Transformer(run.model).eval()
    peer.load_params(theirs, jax.tree.map(np.asarray, params))
    found = torch_search.search(theirs, sources, beam_size=beam_size, alpha=alpha,
                                max_extra_length=extra)
    max_length = found.shape[1]  # the longest source's limit; ours pads to its bucket's
    np.testing.assert_array_equal(found.numpy(), expected[:, :max_length])
    assert not expected[:, max_length:].any()
