"""kernels/config.py refuses tiles that the kernels cannot run, before anything is
compiled."""

import dataclasses
import importlib
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def config(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    return importlib.import_module("kernels.config")


@pytest.mark.parametrize("q_stages", [1, 3])
def test_pair_tiles_need_two_q_stages(config, q_stages):
    pair = config._BWD_TILES[192]
    assert pair.pair and pair.q_stages == 2
    with pytest.raises(AssertionError, match="q_stages == 2"):
        dataclasses.replace(pair, q_stages=q_stages)
    dataclasses.replace(pair, q_stages=q_stages, pair=False)  # the check is on pairs only
