"""The kernels inside XLA command buffers (CUDA graphs), forced on for custom calls: the
forward, and the backward with its XLA-allocated workspaces in both dq modes; segment
ids and varlen offsets that change between replays of one recorded graph; a decode step
(split-KV and paged) whose lengths and page table change between replays.

XLA reads XLA_FLAGS once, when the backend starts, so the jitted function runs in a
subprocess; it saves its inputs, outputs and compiled HLO, and this process checks them.
Since jax 0.11 (XLA's thunk-level command buffer pass) command buffers do not show in
the compiled HLO; XLA's dump of the thunk sequence shows them (`kCommandBuffer`, with
the thunks it holds indented below it).
"""

import functools
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _api, _paged

pytestmark = pytest.mark.gpu

XLA_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"

FORWARD_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_fa4

    @jax.jit
    def attention_in_graph(q, k, v):
        # Fusions before and after the custom call, so a command buffer can hold them all.
        q = (q.astype(jnp.float32) * 2).astype(q.dtype)
        out, lse = jax_fa4.attention(q, k, v, causal=True, return_lse=True,
                                     implementation="cute")
        return q, out, lse, jnp.sum(jnp.tanh(lse)) + jnp.sum(out.astype(jnp.float32) ** 2)

    saved = {}
    for i, seed in enumerate((0, 1)):
        q, k, v = (jax.random.normal(key, (2, 700, 4, 128), jnp.float32).astype(jnp.bfloat16)
                   for key in jax.random.split(jax.random.key(seed), 3))
        if i == 0:
            saved["hlo"] = np.array(attention_in_graph.lower(q, k, v).compile().as_text())
        # The first call records the graph, later calls replay it (with new data for i=1).
        calls = [attention_in_graph(q, k, v) for _ in range(3)]
        for j, (q2, out, lse, extra) in enumerate(calls):
            for name, x in (("out", out), ("lse", lse), ("extra", extra)):
                saved[f"{name}_{i}_{j}"] = np.asarray(x, np.float32)
        for name, x in (("q", q2), ("k", k), ("v", v)):
            saved[f"{name}_{i}"] = np.asarray(x, np.float32)  # bf16 -> f32 is exact
    np.savez(sys.argv[1], **saved)
""")


BACKWARD_SCRIPT = textwrap.dedent("""
    import functools, sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_fa4

    def backward(q, k, v, dout, dlse, deterministic):
        attn = functools.partial(jax_fa4.attention, causal=True, return_lse=True,
                                 implementation="cute", deterministic=deterministic)
        return jax.vjp(attn, q, k, v)[1]((dout, dlse))

    @jax.jit
    def backward_in_graph(q, k, v, dout, dlse):
        # Fusions before and after the custom calls, so a command buffer can hold them all.
        q = (q.astype(jnp.float32) * 2).astype(q.dtype)
        grads = {"det": backward(q, k, v, dout, dlse, True),
                 "atomic": backward(q, k, v, dout, dlse, False)}
        return q, grads, sum(jnp.sum(g[0].astype(jnp.float32) ** 2) for g in grads.values())

    saved = {}
    for i, seed in enumerate((0, 1)):
        kq, kk, kv, kdo, kdl = jax.random.split(jax.random.key(seed), 5)
        q, k, v, dout = (jax.random.normal(key, (2, 700, 4, 128), jnp.float32).astype(jnp.bfloat16)
                         for key in (kq, kk, kv, kdo))
        dlse = jax.random.normal(kdl, (2, 4, 700), jnp.float32)
        if i == 0:
            saved["hlo"] = np.array(backward_in_graph.lower(q, k, v, dout, dlse).compile().as_text())
        # The first call records the graph, later calls replay it (with new data for i=1).
        calls = [backward_in_graph(q, k, v, dout, dlse) for _ in range(3)]
        for j, (q2, grads, extra) in enumerate(calls):
            for mode, g in grads.items():
                for name, x in zip(("dq", "dk", "dv"), g):
                    saved[f"{name}_{mode}_{i}_{j}"] = np.asarray(x, np.float32)
            saved[f"extra_{i}_{j}"] = np.asarray(extra)
        for name, x in (("q", q2), ("k", k), ("v", v), ("dout", dout), ("dlse", dlse)):
            saved[f"{name}_{i}"] = np.asarray(x, np.float32)  # bf16 -> f32 is exact
    np.savez(sys.argv[1], **saved)
""")


# Segment and varlen calls whose runtime arrays change between replays; the parent
# process runs the same functions without forced command buffers to compare.
SEGMENT_FUNCTIONS = textwrap.dedent("""
    import functools
    import jax, jax.numpy as jnp, numpy as np
    import jax_fa4

    S = 600

    def loss(q, k, v, cu, ids):
        varlen = jax_fa4.attention_varlen(
            q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S,
            max_seqlen_k=S, causal=True, implementation="cute", deterministic=True)
        segments = jax_fa4.attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids,
                                     causal=True, implementation="cute", deterministic=True)
        return (jnp.sum(varlen.astype(jnp.float32) ** 2)
                + jnp.sum(segments.astype(jnp.float32) ** 2), (varlen, segments))

    @jax.jit
    def segments_in_graph(q, k, v, cu, ids):
        q = (q.astype(jnp.float32) * 2).astype(q.dtype)
        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, cu, ids)

    def inputs():
        q, k, v = (jax.random.normal(key, (2, S, 4, 128), jnp.float32).astype(jnp.bfloat16)
                   for key in jax.random.split(jax.random.key(3), 3))
        # Offsets in range, with an empty sequence, and out of range (clipped by contract).
        offsets = ([0, 100, 350, S], [0, 0, 512, S], [0, 300, 900, 200])
        rng = np.random.default_rng(0)
        ids = [np.sort(rng.integers(0, n, (2, S)), -1) for n in (2, 5, 9)]
        return (q, k, v), [(jnp.array(c, jnp.int32), jnp.asarray(i, jnp.int32))
                           for c, i in zip(offsets, ids)]
""")

SEGMENT_SCRIPT = SEGMENT_FUNCTIONS + textwrap.dedent("""
    import sys
    (q, k, v), arrays = inputs()
    saved = {"hlo": np.array(segments_in_graph.lower(q, k, v, *arrays[0]).compile().as_text())}
    for i, (cu, ids) in enumerate(arrays * 2):  # every value twice, in one recorded graph
        result = segments_in_graph(q, k, v, cu, ids)
        for j, x in enumerate(jax.tree.leaves(result)):
            saved[f"result_{i}_{j}"] = np.asarray(x, np.float32)
    np.savez(sys.argv[1], **saved)
""")


def _custom_calls_in_command_buffers(thunks: str) -> list[int]:
    """Ids of the kCustomCall thunks nested in a kCommandBuffer, from XLA's dump
    `*.thunk_sequence_after_thunk_passes.txt` (nesting is shown by indentation)."""
    inside, enclosing = [], []
    for line in thunks.splitlines():
        m = re.match(r"(\s*)(\d+): (k\w+)", line)
        if not m:
            continue
        indent, thunk_id, kind = len(m[1]), int(m[2]), m[3]
        while enclosing and enclosing[-1][0] >= indent:
            enclosing.pop()
        if kind == "kCustomCall" and any(k == "kCommandBuffer" for _, k in enclosing):
            inside.append(thunk_id)
        enclosing.append((indent, kind))
    return inside


def _run_with_forced_command_buffers(script: str, function: str, tmp_path):
    """Runs `script` in a subprocess with command buffers forced on; -> (its saved
    arrays, the compiled HLO's custom-call targets, the ids of the custom-call thunks
    inside command buffers in the jitted `function`)."""
    result, dump = tmp_path / "result.npz", tmp_path / "xla_dump"
    package_root = pathlib.Path(jax_fa4.__file__).resolve().parents[1]
    flags = f"{XLA_FLAGS} --xla_dump_to={dump}"
    env = dict(os.environ,
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip(),
               # This process already holds most of the GPU memory.
               XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(package_root),
                                                        os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", script, str(result)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    saved = np.load(result)
    targets = re.findall(r'custom_call_target="([^"]+)"', str(saved["hlo"]))
    dumps = sorted(dump.glob(f"*jit_{function}*.thunk_sequence_after_thunk_passes.txt"))
    assert dumps, f"no thunk sequence dumped in {dump}"
    thunks = dumps[0].read_text()
    assert "kCommandBuffer" in thunks, thunks
    return saved, targets, _custom_calls_in_command_buffers(thunks)


def test_kernel_in_forced_command_buffer(fa, tmp_path):
    saved, targets, in_buffers = _run_with_forced_command_buffers(
        FORWARD_SCRIPT, "attention_in_graph", tmp_path)
    # The kernel's call is the only custom call, so a custom-call thunk inside a command
    # buffer is it.
    assert targets == ["jax_fa4_fwd"], targets
    assert in_buffers, "jax_fa4_fwd is not inside a command buffer"

    for i in (0, 1):
        q, k, v = (jnp.asarray(saved[f"{n}_{i}"], jnp.bfloat16) for n in "qkv")
        out, lse = saved[f"out_{i}_0"], saved[f"lse_{i}_0"]
        fa.assert_attention(f"inputs {i}", jnp.asarray(out, jnp.bfloat16), lse, q, k, v,
                            causal=True)
        extra = np.sum(np.tanh(lse)) + np.sum(out.astype(np.float64) ** 2)
        np.testing.assert_allclose(saved[f"extra_{i}_0"], extra, rtol=1e-4)
        for j in (1, 2):  # replays of the recorded graph give the same bits
            for name in ("out", "lse", "extra"):
                np.testing.assert_array_equal(saved[f"{name}_{i}_{j}"], saved[f"{name}_{i}_0"])


def test_backward_in_forced_command_buffer(fa, tmp_path):
    saved, targets, in_buffers = _run_with_forced_command_buffers(
        BACKWARD_SCRIPT, "backward_in_graph", tmp_path)
    # One backward per mode; the forwards of the two modes are identical calls, which
    # XLA may merge. They are the only custom calls, and all inside command buffers.
    assert targets.count("jax_fa4_bwd") == 2 and set(targets) == {"jax_fa4_fwd", "jax_fa4_bwd"}
    assert len(in_buffers) == len(targets), f"custom calls in command buffers: {in_buffers}"

    for i in (0, 1):
        q, k, v, dout = (jnp.asarray(saved[f"{n}_{i}"], jnp.bfloat16)
                         for n in ("q", "k", "v", "dout"))
        dlse = saved[f"dlse_{i}"]
        for mode in ("det", "atomic"):
            grads = [jnp.asarray(saved[f"{n}_{mode}_{i}_0"], jnp.bfloat16)
                     for n in ("dq", "dk", "dv")]
            fa.assert_gradients(f"inputs {i} {mode}", grads, q, k, v, dout, dlse, causal=True)
        extra = sum(np.sum(saved[f"dq_{mode}_{i}_0"].astype(np.float64) ** 2)
                    for mode in ("det", "atomic"))
        np.testing.assert_allclose(saved[f"extra_{i}_0"], extra, rtol=1e-4)
        for j in (1, 2):  # deterministic replays of the recorded graph give the same bits
            for name in ("dq", "dk", "dv"):
                np.testing.assert_array_equal(saved[f"{name}_det_{i}_{j}"],
                                              saved[f"{name}_det_{i}_0"])


def test_segments_and_varlen_with_changing_offsets_in_command_buffers(tmp_path):
    saved, targets, in_buffers = _run_with_forced_command_buffers(
        SEGMENT_SCRIPT, "segments_in_graph", tmp_path)
    assert targets.count("jax_fa4_fwd") >= 2 and targets.count("jax_fa4_bwd") == 2, targets
    assert set(targets) == {"jax_fa4_fwd", "jax_fa4_bwd"}, targets
    # XLA (jax 0.11.2) holds two of the four custom calls in command buffers here
    # (H200, 2026-12-02), where the other tests' calls are all inside.
    assert len(in_buffers) >= 2, f"custom calls in command buffers: {in_buffers}"
    here = {}
    exec(SEGMENT_FUNCTIONS, here)  # the same functions, without forced command buffers
    (q, k, v), arrays = here["inputs"]()
    for i, (cu, ids) in enumerate(arrays * 2):
        want = jax.tree.leaves(here["segments_in_graph"](q, k, v, cu, ids))
        for j, x in enumerate(want):  # the loss, then the outputs and gradients
            compare = (functools.partial(np.testing.assert_allclose, rtol=1e-6) if j == 0
                       else np.testing.assert_array_equal)
            compare(saved[f"result_{i}_{j}"], np.asarray(x, np.float32),
                    err_msg=f"offsets {i % 3}, result {j}")


# A decode step whose lengths and page table change between replays of one recorded
# graph: the split-KV kernel with its combine (partials in XLA-allocated results) and
# the paged kernel. The parent process runs the same function without forced command
# buffers to compare.
DECODE_FUNCTIONS = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import jax_fa4

    B, SK, H, HKV, D, PAGE = 2, 4099, 8, 2, 128, 64
    PAGES = -(-SK // PAGE)

    @jax.jit
    def decode_in_graph(q, k, v, k_cache, v_cache, lengths, table):
        # A fusion before the custom calls, so a command buffer can hold them with it.
        q = (q.astype(jnp.float32) * 2).astype(q.dtype)
        split = jax_fa4.attention(q, k, v, kv_lengths=lengths, return_lse=True,
                                  implementation="cute")
        paged = jax_fa4.paged_attention(q, k_cache, v_cache, table, lengths,
                                        return_lse=True, implementation="cute")
        return q, split, paged

    def inputs():
        rng = np.random.default_rng(5)
        def normal(shape):
            return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        q, k, v = normal((B, 1, H, D)), normal((B, SK, HKV, D)), normal((B, SK, HKV, D))
        k_cache, v_cache = (normal((B * PAGES + 3, PAGE, HKV, D)) for _ in range(2))
        # Lengths that end inside a page, fill the keys, past them (clipped) and empty.
        lengths = ([1, 2], [SK, 17], [SK + 300, 0], [4000, 1000])
        tables = [rng.permutation(B * PAGES + 3)[:B * PAGES].reshape(B, PAGES)
                  for _ in lengths]
        return (q, k, v, k_cache, v_cache), [(jnp.asarray(n, jnp.int32),
                                              jnp.asarray(t, jnp.int32))
                                             for n, t in zip(lengths, tables)]
""")

DECODE_SCRIPT = DECODE_FUNCTIONS + textwrap.dedent("""
    import sys
    arrays, steps = inputs()
    saved = {"hlo": np.array(decode_in_graph.lower(*arrays, *steps[0]).compile().as_text())}
    for i, step in enumerate(steps * 2):  # every value twice, in one recorded graph
        for j, x in enumerate(jax.tree.leaves(decode_in_graph(*arrays, *step))):
            saved[f"result_{i}_{j}"] = np.asarray(x, np.float32)
    np.savez(sys.argv[1], **saved)
""")


def test_split_and_paged_decode_with_changing_lengths_in_command_buffers(fa, tmp_path):
    saved, targets, in_buffers = _run_with_forced_command_buffers(
        DECODE_SCRIPT, "decode_in_graph", tmp_path)
    assert targets == ["jax_fa4_fwd"] * 2, targets
    assert len(in_buffers) == 2, f"custom calls in command buffers: {in_buffers}"
    here = {}
    exec(DECODE_FUNCTIONS, here)
    (q, k, v, k_cache, v_cache), steps = here["inputs"]()
    spec = _api._plan(q, k, v, causal=False, softmax_scale=None, return_lse=True,
                      implementation="cute", kv_lengths=steps[0][0])
    assert spec.split_kernel and spec.num_splits > 1, spec
    for i, (lengths, table) in enumerate(steps * 2):
        want = jax.tree.leaves(here["decode_in_graph"](q, k, v, k_cache, v_cache, lengths,
                                                       table))
        for j, x in enumerate(want):  # q, then out and lse of split, then of paged
            np.testing.assert_array_equal(saved[f"result_{i}_{j}"], np.asarray(x, np.float32),
                                          err_msg=f"step {i}, result {j}")
        q2, split, paged = want[0], want[1:3], want[3:]
        fa.assert_attention(f"split, lengths {lengths}", *split, q2, k, v, causal=False,
                            segments={"kv_lengths": jnp.clip(lengths, 0, k.shape[1])})
        # The paged call clips lengths to its table's pages, not to SK.
        k_pages, v_pages = (_paged.gather(c, table) for c in (k_cache, v_cache))
        fa.assert_attention(f"paged, lengths {lengths}", *paged, q2, k_pages, v_pages,
                            causal=True,
                            segments={"kv_lengths": jnp.clip(lengths, 0, k_pages.shape[1])})
