"""Generation (transformer.inference.generator) on tiny randomly initialised language models:
prompts
padded into length buckets and batches give the tokens they give alone, and a stream of
prompts of many lengths compiles one program per bucket and batch shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

from transformer.data import tokenizer as tokenizer_lib
from transformer.inference import generator as generator_lib
from transformer.inference.translator import BUCKET
from transformer.model.transformer import Transformer, TransformerConfig

V = 32
TINY = dict(vocab_size=V, d_model=16, d_ff=32, num_heads=2, num_kv_heads=1, num_encoder_layers=0,
            num_decoder_layers=2, max_len=64, dropout_rate=0.0, norm_position="pre",
            use_bias=False, tie_output_embedding=False, architecture="decoder")
# Weights scaled so that attention dominates the embeddings: the tokens then depend on every
# position the model reads (at the initialiser's scale the next token mostly follows the
# current one, and a pad read by mistake could go unnoticed).
SCALES = {"embedding": 0.1, "attention": 2.0, "logits": 3.0}


class CharTokenizer:
    """One piece per character (ids 4..V-1), enough for `Generator.generate`."""

    eos_ids = (3,)

    def encode(self, texts):
        return [[4 + ord(c) % (V - 4) for c in text] for text in texts]

    def decode(self, ids):
        return "".join(chr(97 + (i - 4) % 26) if i >= 4 else f"<{i}>" for i in ids)


def tiny_generator(objective="causal", **model):
    values = {**TINY, **model}
    module = Transformer(TransformerConfig(**values))
    params = module.init(jax.random.key(0), None, jnp.ones((1, 4), jnp.int32))["params"]
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * next((scale for name, scale in SCALES.items()
                                  if name in jax.tree_util.keystr(path)), 1.0), params)
    config = ConfigDict({"model": values, "data": {"objective": objective}})
    return generator_lib.Generator(config, TransformerConfig(**values), params,
                                   CharTokenizer())


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, V, n).tolist() for n in lengths]


GREEDY = dict(max_new_tokens=10, temperature=0.0, top_k=0, top_p=1.0)
SAMPLED = dict(max_new_tokens=10, temperature=1.0, top_k=0, top_p=0.95)


@pytest.mark.parametrize("objective, model", [
    ("causal", dict(positional="rope")),
    ("prefix", dict(positional="sinusoidal", scan_layers=True)),
])
@pytest.mark.parametrize("options", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_padding_to_a_larger_bucket_or_batch_changes_no_token(objective, model, options):
    generator = tiny_generator(objective, **model)
    prompts = prompts_of([3, 9, 14])
    alone = [generator.generate_ids([p], prompt_indices=[i], seed=7, length=1 + len(p), rows=1,
                                    **options)[0] for i, p in enumerate(prompts)]
    assert len({tuple(t) for t in alone}) == 3 and all(t[0] != 0 for t in alone)
    for length, rows in ((BUCKET, 4), (3 * BUCKET, 8)):
        padded = generator.generate_ids(prompts, prompt_indices=[0, 1, 2], seed=7,
                                        length=length, rows=rows, **options)
        np.testing.assert_array_equal(padded, np.stack(alone), err_msg=f"{length=} {rows=}")


def test_greedy_generation_follows_the_argmax_of_the_full_forward_pass():
    generator = tiny_generator("causal", positional="sinusoidal")
    (prompt,) = prompts_of([5])
    tokens = generator.generate_ids([prompt], prompt_indices=[0], seed=0, length=BUCKET,
                                    **GREEDY)[0]
    forward = jax.jit(lambda targets: generator.model.apply({"params": generator.params}, None,
                                                            targets))
    sequence = list(prompt)
    for _ in range(GREEDY["max_new_tokens"]):
        # Position t reads the targets before t (causal): those after are any nonzero token.
        targets = np.full((1, BUCKET), 4, np.int32)
        targets[0, :len(sequence)] = sequence
        logits = np.asarray(forward(targets)[0, len(sequence)]).copy()
        logits[0] = -np.inf  # padding is never drawn
        sequence.append(int(logits.argmax()))
    generated = sequence[len(prompt):]
    assert tokenizer_lib.EOS_ID not in generated  # (this prompt runs to max_new_tokens)
    np.testing.assert_array_equal(tokens, generated)


def test_prompts_of_many_lengths_compile_one_program_per_bucket_and_batch_shape():
    generator = tiny_generator("causal", positional="rope")
    generator_lib._sample_fn.cache_clear()
    options = dict(max_new_tokens=4, temperature=0.0)
    text = "abcdefghijklmnopqrstuvwxyz" * 2
    prompts = [text[:n] for n in range(1, 46)]  # 2..46 decoder inputs: buckets 16, 32, 48
    texts = generator.generate(prompts, batch_size=4, **options)
    alone = [generator.generate([p], **options)[0] for p in prompts]
    assert texts == alone
    run = generator_lib._sample_fn(generator.model, False, 4, 0.0, 0, 1.0, (), False)
    # (rows, length): 4 x 16, 4 x 32, 4 x 48 and 2 x 48 for the last two prompts, 1 x each
    # bucket alone; 45 lengths would have compiled 45 programs or more.
    assert run._cache_size() == 7
    assert {generator.bucket(len(p), 4) for p in prompts} == {16, 32, 48}


def test_a_streamed_generation_equals_the_batch_api(untrained_lm_workdir, tmp_path):
    """200 prompts through the CLI, sampled (4-prompt batches read 32 at a time, written as
    they go), give what one call of the API gives: prompt i draws with key i in either."""
    import pathlib
    import subprocess
    import sys

    from conftest import TRANSLATION_SENTENCES

    prompts = [" ".join(TRANSLATION_SENTENCES[i % 6].split()[: 1 + i % 4]) for i in range(200)]
    source = tmp_path / "prompts.txt"
    source.write_text("\n".join(prompts) + "\n")
    options = ["--max_new_tokens=4", "--temperature=1.0", "--top_k=0", "--top_p=1.0",
               "--seed=3"]
    result = subprocess.run([sys.executable, "-m", "transformer.generate",
                             f"--workdir={untrained_lm_workdir}", "--batch_size=4", *options,
                             f"--input={source}"], capture_output=True, timeout=600,
                            cwd=pathlib.Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    streamed = result.stdout.decode().split("\n")
    assert streamed[-1] == "" and len(streamed) == 201
    generator = generator_lib.load_generator(str(untrained_lm_workdir))
    expected = generator.generate(prompts, max_new_tokens=4, temperature=1.0, top_k=0,
                                  top_p=1.0, seed=3, batch_size=4)
    # Sampled with one key per prompt index: the same prompt at another index draws otherwise
    # (a stream restarting its count at each chunk would not match).
    assert len({text for text, p in zip(expected, prompts, strict=True) if p == prompts[0]}) > 1
    assert streamed[:-1] == expected
