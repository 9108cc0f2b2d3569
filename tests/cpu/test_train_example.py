"""examples/train_gpt.py trains on the CPU, and jax_fa4 follows XLA's loss curve."""

import importlib.util
import math
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

STEPS = ["--preset", "cpu", "--steps", "12", "--log-every", "4"]
# jax_fa4 (its reference on the CPU) and XLA both compute bf16 q @ k with fp32 scores
# and softmax; they differ in where they round to bf16. Over the 4 logged steps of
# seeds 0 to 4 their losses differed by at most 3.7e-3 (XLA against itself, run under
# CPU load, by 2e-3). 1e-2 leaves room for that and is still ~200x below the fall of
# the loss in those 12 steps (2.2 to 2.9).
LOSS_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def train_gpt():
    spec = importlib.util.spec_from_file_location(
        "train_gpt", REPO / "examples" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def records(train_gpt):
    return {name: train_gpt.main([*STEPS, "--attention", name])
            for name in ("xla", "jax_fa4")}


@pytest.mark.parametrize("attention", ["xla", "jax_fa4"])
def test_loss_falls(records, attention):
    record = records[attention]
    assert record["steps"] == [1, 4, 8, 12]
    assert all(math.isfinite(x) for x in record["losses"])
    # ~4.7 at the start (ln 64 = 4.16, plus the spread of the initial logits).
    assert record["losses"][-1] < record["losses"][0] - 1.5
    if attention == "jax_fa4":
        # No Hopper GPU here: the reference runs (the path names why).
        assert "reference" in record["path"]


def test_jax_fa4_matches_xla(records):
    for fa4, xla in zip(records["jax_fa4"]["losses"], records["xla"]["losses"]):
        assert abs(fa4 - xla) < LOSS_TOLERANCE


def test_sequence_sharded_training_follows_one_device(train_gpt):
    # 8 CPU devices (tests/conftest.py): 16 positions each, through jax_fa4's ring. Two
    # heads of 64 (one K/V head) take the kernel path, whose per-platform branch runs the
    # reference on the CPU inside each ring step.
    heads = ["--heads", "2", "--kv-heads", "1"]
    single, sharded = (train_gpt.main([*STEPS, *heads, "--attention", "jax_fa4", *shard])
                       for shard in ([], ["--shard", "seq"]))
    assert (sharded["shard"], sharded["devices"]) == ("seq", 8)
    for a, b in zip(sharded["losses"], single["losses"]):
        assert abs(a - b) < LOSS_TOLERANCE


def test_data_parallel_training_follows_one_device(train_gpt):
    runs = [train_gpt.main([*STEPS, "--attention", "jax_fa4", "--batch", "8", *shard])
            for shard in ([], ["--shard", "data"])]
    assert runs[1]["devices"] == 8
    for sharded, single in zip(runs[1]["losses"], runs[0]["losses"]):
        assert abs(sharded - single) < LOSS_TOLERANCE


@pytest.mark.parametrize("arguments,named", [
    (["--kv-heads", "0"], "kv_heads"), (["--log-every", "0"], "log_every"),
    (["--batch", "0"], "batch"), (["--lr", "-1"], "lr")])
def test_bad_sizes_are_argument_errors(train_gpt, capsys, arguments, named):
    # ZeroDivisionError, or a nan loss at step 10 for a batch of 0.
    with pytest.raises(SystemExit):
        train_gpt.parse(["--preset", "cpu", *arguments])
    assert f"not so: {named}" in capsys.readouterr().err


@pytest.mark.parametrize("arguments,message", [
    (["--vocab", "4"], "--vocab must be above 4"),  # had been numpy's sampling error
    (["--lr", "nan"], "--lr must be finite"),  # had trained to a nan loss
    (["--lr", "inf"], "--lr must be finite")])
def test_bad_values_are_argument_errors(train_gpt, capsys, arguments, message):
    with pytest.raises(SystemExit):
        train_gpt.parse(["--preset", "cpu", *arguments])
    assert message in capsys.readouterr().err
