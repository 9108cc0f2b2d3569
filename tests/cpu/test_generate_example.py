"""examples/generate.py decodes on the CPU: the paged cache (jax_fa4) and the dense one
(jax.nn) give the tokens that recomputing the whole prefix without a cache gives."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def generate():
    spec = importlib.util.spec_from_file_location("generate", REPO / "examples" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _uncached(generate, cfg, params, prompts):
    """Greedy tokens by running the whole sequence so far at every step (no cache)."""
    model = generate.Dense(cfg, "xla")
    seq = prompts
    for _ in range(cfg.new):
        positions = jnp.broadcast_to(jnp.arange(seq.shape[1]), seq.shape)
        logits, _ = generate.forward(cfg, params, seq, positions, model.empty(),
                                     model.prefill)
        seq = jnp.concatenate([seq, jnp.argmax(logits, -1).astype(jnp.int32)[:, None]], 1)
    return np.asarray(seq[:, prompts.shape[1]:])


def test_caches_decode_the_uncached_tokens(generate):
    _, cfg = generate.parse(["--preset", "cpu", "--new", "10"])
    k_params, k_prompt, k_pages = jax.random.split(jax.random.key(3), 3)
    params = generate.init_params(cfg, k_params)
    prompts = jax.random.randint(k_prompt, (cfg.batch, cfg.prompt), 0, cfg.vocab, jnp.int32)
    want = _uncached(generate, cfg, params, prompts)
    for model in (generate.Paged(cfg, k_pages), generate.Dense(cfg, "xla")):
        got = np.asarray(jax.jit(lambda p, t, m=model: generate.generate(cfg, p, t, m))(
            params, prompts))
        assert got.shape == (cfg.batch, cfg.new)
        # Random weights make near-ties, where roundings may differ; a wrong cache
        # (positions, pages, lengths) agrees on ~1 token in vocab.
        assert np.mean(got == want) >= 0.9, (type(model).__name__, got, want)


def test_main_prints_both_rates(generate, tmp_path, capsys):
    record = generate.main(["--preset", "cpu", "--repeats", "1", "--json",
                            str(tmp_path / "run.jsonl")])
    assert set(record["tokens_per_s"]) == {"jax_fa4 paged", "jax.nn xla dense"}
    assert all(rate > 0 for rate in record["tokens_per_s"].values())
    # Fed the same tokens, the paged and dense caches give the same logits up to
    # rounding (a wrong cache: positions, pages or lengths, would not).
    assert record["agree"] >= 0.9
    assert record["logit_difference"] < 0.05 * record["largest_logit"], record
    assert record["paged_path"] == "the reference on gathered pages (no GPU)"
    out = capsys.readouterr().out
    assert "tokens/s" in out and "greedy tokens agree at" in out
    assert (tmp_path / "run.jsonl").read_text().count("\n") == 1


def test_json_and_profile_arguments_are_checked_first(generate, tmp_path, capsys):
    # A bad --json path had raised after the timed runs; --profile had ignored --json.
    with pytest.raises(SystemExit):
        generate.parse(["--preset", "cpu", "--json", str(tmp_path / "no" / "run.jsonl")])
    assert "--json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.parse(["--preset", "cpu", "--profile", "--json", str(tmp_path / "r")])
    assert "drop --json" in capsys.readouterr().err


@pytest.mark.parametrize("arguments,named", [
    (["--kv-heads", "0"], "kv_heads"), (["--batch", "0"], "batch"),
    (["--repeats", "0"], "repeats"), (["--width", "30"], "--heads must divide --width")])
def test_bad_sizes_are_argument_errors(generate, capsys, arguments, named):
    # They had been tracebacks (ZeroDivisionError, statistics' empty median, a split).
    with pytest.raises(SystemExit):
        generate.parse(["--preset", "cpu", *arguments])
    assert named in capsys.readouterr().err
