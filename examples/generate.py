"""Greedy decoding of a small GPT with a KV cache: a paged cache on jax_fa4 next to a
dense cache on jax.nn (cuDNN on a GPU, XLA on a CPU), the same weights and prompts.

    python examples/generate.py --preset gpu --batch 1
    python examples/generate.py --preset gpu --batch 32 --page-size 64
    python examples/generate.py --preset cpu                 # seconds, both on XLA / reference
    python examples/generate.py --preset gpu --batch 32 --profile   # kernels of a run

Each run prefills the prompt once (causal attention over the prompt's own keys and
values, `jax_fa4.attention` / `jax.nn.dot_product_attention`, which are then written into
the cache), which gives the first new token, then decodes the other --new - 1 one a step under one
jit (`lax.fori_loop`): each step's keys and values are written into the cache at the
sequence's length, and it attends to the cache. The paged model keeps every layer's K
and V in a pool of pages (num_pages, page_size, Hkv, D) that a page table maps
sequences onto, in a shuffled order, and attends with `jax_fa4.paged_attention`, whose
kernel also writes the step's keys and values into their pages (k_new, v_new); the
dense model keeps (B, max_len, Hkv, D) per layer, writes them with a
dynamic_update_slice and attends with
`jax.nn.dot_product_attention` and key_value_seq_lengths. Prints tokens/s of whole runs,
prefill included, for both (batch x --new tokens over the median of --repeats timed
runs, the two models' runs alternated after a warm-up of each, so that drifting clocks
touch both alike), and which path the paged calls take (the paged kernel reads the pages
in place at page sizes that are multiples of 16 and head dims 64, 128 and 256; other
calls gather the pages first).

The weights are random (this measures decoding, not a trained model): greedy decoding
then lands on near-ties now and then, where the two paths' roundings can pick different
tokens, after which the two continuations part. So the check printed feeds both models
the same tokens (the paged model's) and compares their next-token logits at every step:
the largest difference, and how many steps' greedy tokens agree.

--profile prints, instead, the GPU kernels of one whole run (prefill and decode loop, as
timed) of each model, summed by kernel name (CUPTI through JAX's Mosaic GPU profiler),
to see where the two models' time differs. A decode step profiled alone would differ
from a step in the loop: it takes the caches as arguments, which it cannot update in
place, and XLA copies them first.
"""

import argparse
import dataclasses
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from jax_fa4 import _registry

PRESETS = {
    "gpu": {"layers": 8, "width": 2048, "heads": 32, "kv_heads": 8, "vocab": 32768,
            "prompt": 1024, "new": 256, "batch": 1, "page_size": 64},
    "cpu": {"layers": 2, "width": 128, "heads": 4, "kv_heads": 2, "vocab": 256,
            "prompt": 24, "new": 12, "batch": 2, "page_size": 16},
}


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int
    width: int
    heads: int
    kv_heads: int
    vocab: int
    prompt: int
    new: int
    batch: int
    page_size: int

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def max_len(self) -> int:
        """Cache capacity per sequence: prompt and new tokens, in whole pages."""
        pages = -(-(self.prompt + self.new) // self.page_size)
        return pages * self.page_size


def init_params(cfg: Config, key):
    """bf16 weights, scaled so activations keep unit size."""
    d, hd = cfg.width, cfg.head_dim
    qkv = (cfg.heads + 2 * cfg.kv_heads) * hd
    keys = iter(jax.random.split(key, 2 + 4 * cfg.layers))

    def dense(shape):
        return (jax.random.normal(next(keys), shape) / np.sqrt(shape[0])).astype(jnp.bfloat16)

    layers = [{"qkv": dense((d, qkv)), "out": dense((cfg.heads * hd, d)),
               "up": dense((d, 4 * d)), "down": dense((4 * d, d))}
              for _ in range(cfg.layers)]
    return {"embed": dense((cfg.vocab, d)), "head": dense((d, cfg.vocab)),
            "layers": layers}


def rms(x):
    x = x.astype(jnp.float32)
    return (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)


def rope(x, positions, base=10000.0):
    """x (B, S, H, D) rotated at positions (B, S)."""
    dim = x.shape[-1]
    angle = positions[..., None] * base ** (-jnp.arange(dim // 2) * 2 / dim)
    cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def forward(cfg: Config, params, tokens, positions, caches, attend):
    """tokens (B, S) at positions (B, S) -> logits of the last token (B, vocab), caches
    updated. attend(q, k, v, cache) -> (out, cache): the tokens' attention, their keys
    and values stored in the cache."""
    b, s = tokens.shape
    hd = cfg.head_dim
    x = params["embed"][tokens]
    updated = []
    for layer, cache in zip(params["layers"], caches):
        q, k, v = jnp.split(rms(x) @ layer["qkv"],
                            [cfg.heads * hd, (cfg.heads + cfg.kv_heads) * hd], -1)
        q = rope(q.reshape(b, s, cfg.heads, hd), positions)
        k = rope(k.reshape(b, s, cfg.kv_heads, hd), positions)
        v = v.reshape(b, s, cfg.kv_heads, hd)
        out, cache = attend(q, k, v, cache)
        updated.append(cache)
        x = x + out.reshape(b, s, -1) @ layer["out"]
        x = x + jax.nn.gelu(rms(x) @ layer["up"]) @ layer["down"]
    return (rms(x[:, -1]) @ params["head"]).astype(jnp.float32), updated


class Dense:
    """Cache (B, max_len, Hkv, D) per layer for K and V; jax.nn attends."""

    def __init__(self, cfg: Config, implementation):
        self.cfg, self.implementation = cfg, implementation

    def empty(self):
        shape = (self.cfg.batch, self.cfg.max_len, self.cfg.kv_heads, self.cfg.head_dim)
        return [(jnp.zeros(shape, jnp.bfloat16),) * 2 for _ in range(self.cfg.layers)]

    def write(self, length, cache, k, v):
        """New keys at positions length .. length + S - 1 of every sequence."""
        def put(c, x):
            return jax.lax.dynamic_update_slice(c, x, (0, length, 0, 0))
        return put(cache[0], k), put(cache[1], v)

    def prefill(self, q, k, v, cache):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                           implementation=self.implementation)
        return out, self.write(0, cache, k, v)

    def decode(self, length, q, k, v, cache):
        """A decode step's query sees the whole cached length, its own key included."""
        cache = self.write(length, cache, k, v)
        lengths = jnp.full((q.shape[0],), length + q.shape[1], jnp.int32)
        return jax.nn.dot_product_attention(
            q, cache[0], cache[1], key_value_seq_lengths=lengths,
            implementation=self.implementation), cache


class Paged:
    """A pool of pages per layer for K and V, shared by the batch through a page table
    that hands each sequence its pages in a shuffled order; jax_fa4 attends in place,
    and a decode step's call also writes the step's key and value into their page
    (k_new, v_new: no scatter before it)."""

    def __init__(self, cfg: Config, key):
        self.cfg = cfg
        pages = cfg.batch * cfg.max_len // cfg.page_size
        self.table = jax.random.permutation(key, pages).reshape(cfg.batch, -1).astype(jnp.int32)
        self.pool = (pages, cfg.page_size, cfg.kv_heads, cfg.head_dim)

    def empty(self):
        return [(jnp.zeros(self.pool, jnp.bfloat16),) * 2 for _ in range(self.cfg.layers)]

    def write(self, length, cache, k, v):
        """The prompt's keys and values into their pages (prefill)."""
        positions = length + jnp.arange(k.shape[1])
        page = self.table[:, positions // self.cfg.page_size]  # (B, S)
        slot = jnp.broadcast_to(positions % self.cfg.page_size, page.shape)
        # Each sequence owns its pages, so no two rows land in one slot: XLA's scatter
        # may then skip its handling of colliding writes.
        def put(c, x):
            return c.at[page, slot].set(x, unique_indices=True)
        return put(cache[0], k), put(cache[1], v)

    def prefill(self, q, k, v, cache):
        return jax_fa4.attention(q, k, v, causal=True), self.write(0, cache, k, v)

    def decode(self, length, q, k, v, cache):
        lengths = jnp.full((q.shape[0],), length + q.shape[1], jnp.int32)
        out, k_cache, v_cache = jax_fa4.paged_attention(
            q, cache[0], cache[1], self.table, lengths, k_new=k, v_new=v)
        return out, (k_cache, v_cache)


def generate(cfg: Config, params, prompts, model):
    """Prefill the prompts, then cfg.new greedy steps -> (B, new) tokens."""
    positions = jnp.broadcast_to(jnp.arange(cfg.prompt), prompts.shape)
    logits, caches = forward(cfg, params, prompts, positions, model.empty(), model.prefill)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    out = jnp.zeros((cfg.batch, cfg.new), jnp.int32).at[:, 0].set(first)

    def step(i, state):
        out, caches = state
        length = cfg.prompt + i - 1  # tokens already in the cache
        token = out[:, i - 1][:, None]
        position = jnp.full((cfg.batch, 1), length)
        logits, caches = forward(cfg, params, token, position, caches,
                                 functools.partial(model.decode, length))
        return out.at[:, i].set(jnp.argmax(logits, -1).astype(jnp.int32)), caches

    return jax.lax.fori_loop(1, cfg.new, step, (out, caches))[0]


def compare(cfg: Config, params, prompts, first, second):
    """Both models fed the same tokens, `first`'s greedy ones: (the largest difference of
    their next-token logits, the largest logit, the share of steps whose greedy tokens
    agree), over the prefill's and every decode step's logits."""
    positions = jnp.broadcast_to(jnp.arange(cfg.prompt), prompts.shape)
    logits = [forward(cfg, params, prompts, positions, m.empty(), m.prefill) for m in
              (first, second)]

    def measure(logits, worst, scale, agree):
        (a, _), (b, _) = logits
        return (jnp.maximum(worst, jnp.max(jnp.abs(a - b))),
                jnp.maximum(scale, jnp.max(jnp.abs(a))),
                agree + jnp.sum(jnp.argmax(a, -1) == jnp.argmax(b, -1)))

    def step(i, state):
        token, caches, *stats = state
        length = cfg.prompt + i - 1
        position = jnp.full((cfg.batch, 1), length)
        logits = [forward(cfg, params, token[:, None], position, c,
                          functools.partial(m.decode, length))
                  for m, c in zip((first, second), caches)]
        return (jnp.argmax(logits[0][0], -1).astype(jnp.int32),
                [c for _, c in logits], *measure(logits, *stats))

    state = (jnp.argmax(logits[0][0], -1).astype(jnp.int32), [c for _, c in logits],
             *measure(logits, 0.0, 0.0, 0))
    _, _, worst, scale, agree = jax.lax.fori_loop(1, cfg.new, step, state)
    return worst, scale, agree / (cfg.batch * cfg.new)


def paged_path(cfg: Config) -> str:
    """What the paged model's decode steps run: the paged kernel, or the gather."""
    from jax_fa4 import _paged

    if jax.default_backend() != "gpu":
        return "the reference on gathered pages (no GPU)"
    q = jax.ShapeDtypeStruct((cfg.batch, 1, cfg.heads, cfg.head_dim), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((cfg.batch * cfg.max_len // cfg.page_size, cfg.page_size,
                                  cfg.kv_heads, cfg.head_dim), jnp.bfloat16)
    spec = _paged._kernel_spec(
        q, cache, cache, jax.ShapeDtypeStruct((cfg.batch, cfg.max_len // cfg.page_size),
                                              jnp.int32),
        jax.ShapeDtypeStruct((cfg.batch,), jnp.int32), None, implementation=None,
        causal=True, window=None, softcap=None, softmax_scale=None)
    if spec is None:
        return (f"attention on gathered pages (no paged kernel here for pages of "
                f"{cfg.page_size} at head_dim {cfg.head_dim})")
    return "the paged kernel (pages read in place)"


def timed(fns: dict, *args, repeats):
    """{name: (result, median seconds)} of each jitted fn(*args), warmed up (compiled)
    first, then its timed runs alternated with the others'."""
    results = {name: jax.block_until_ready(fn(*args)) for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            results[name] = jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: (results[name], statistics.median(times[name])) for name in fns}


def profile_run(cfg: Config, params, prompts, model, iterations):
    """[(kernel, launches, ms)] of one generate() run, summed by kernel name, longest
    first (CUPTI: each launch's median over the iterations)."""
    from jax.experimental.mosaic.gpu import profiler

    fn = jax.jit(lambda params, prompts: generate(cfg, params, prompts, model))
    _, calls = profiler.measure(fn, aggregate=False, iterations=iterations)(params, prompts)
    totals = {}
    for i, (name, _) in enumerate(calls[0]):
        short = name.split("_object_at_")[0].removeprefix("kernel_cutlass_")[:60]
        launches, ms = totals.get(short, (0, 0.0))
        totals[short] = (launches + 1, ms + statistics.median(c[i][1] for c in calls))
    return sorted(((k, n, ms) for k, (n, ms) in totals.items()), key=lambda r: -r[2])


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=PRESETS,
                    help="default: gpu on a GPU backend, else cpu")
    for name, value in PRESETS["cpu"].items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value),
                        help="overrides the preset")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per model (with --profile: profiled iterations)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="append a JSON record of the run to this file")
    ap.add_argument("--profile", action="store_true",
                    help="print the GPU kernels of one run per model instead")
    args = ap.parse_args(argv)
    if args.profile and args.json:
        ap.error("--profile prints kernels and writes no record: drop --json")
    if args.json:
        try:  # before the runs, not after them
            open(args.json, "a").close()
        except OSError as e:
            ap.error(f"--json {args.json}: {e.strerror}")
    if args.preset is None:  # after parsing: --help starts no backend
        args.preset = "gpu" if jax.default_backend() == "gpu" else "cpu"
    values = {**PRESETS[args.preset],
              **{k: v for k, v in vars(args).items() if k in PRESETS["cpu"] and v is not None}}
    cfg = Config(**values)
    small = [name for name, value in {**values, "repeats": args.repeats}.items() if value < 1]
    if small:
        ap.error(f"sizes and --repeats must be >= 1; not so: {', '.join(small)}")
    if cfg.width % cfg.heads or cfg.heads % cfg.kv_heads or cfg.head_dim % 2:
        ap.error("--heads must divide --width (into an even head_dim, for the rotary "
                 "embedding); --kv-heads must divide --heads")
    return args, cfg


def main(argv=None) -> dict:
    """Decodes with both caches; returns the record that --json appends."""
    args, cfg = parse(argv)
    k_params, k_prompt, k_pages = jax.random.split(jax.random.key(args.seed), 3)
    params = init_params(cfg, k_params)
    prompts = jax.random.randint(k_prompt, (cfg.batch, cfg.prompt), 0, cfg.vocab, jnp.int32)
    dense_impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
    print(f"# {jax.devices()[0].device_kind}: {cfg}")
    path = paged_path(cfg)
    print(f"# jax_fa4 paged decode steps run {path}")
    models = (("jax_fa4 paged", Paged(cfg, k_pages)),
              (f"jax.nn {dense_impl} dense", Dense(cfg, dense_impl)))
    if args.profile:
        if jax.default_backend() != "gpu":
            raise SystemExit("--profile times GPU kernels: it needs a GPU")
        for name, model in models:
            rows = profile_run(cfg, params, prompts, model, args.repeats)
            print(f"{name}: one run {sum(ms for *_, ms in rows):.2f} ms "
                  f"in {sum(n for _, n, _ in rows)} kernels")
            for kernel, launches, ms in rows[:20]:
                print(f"  {ms:9.3f} ms  {launches:6d} x  {kernel}")
        return {}
    fns = {name: jax.jit(lambda params, prompts, model=model: generate(cfg, params, prompts,
                                                                       model))
           for name, model in models}
    runs = {}
    for name, (tokens, seconds) in timed(fns, params, prompts, repeats=args.repeats).items():
        runs[name] = (np.asarray(tokens), seconds)
        print(f"{name:>22}: {cfg.batch * cfg.new / seconds:10.1f} tokens/s "
              f"({seconds * 1e3:.1f} ms for {cfg.new} tokens x batch {cfg.batch}, "
              "prefill included)")
    (_, t_paged), (_, t_dense) = runs.values()
    print(f"paged / dense time: {t_paged / t_dense:.2f}")
    worst, scale, agree = (float(x) for x in jax.jit(lambda params, prompts: compare(
        cfg, params, prompts, *(model for _, model in models)))(params, prompts))
    print(f"fed the same tokens: next-token logits differ by at most {worst:.3g} (largest "
          f"logit {scale:.3g}); greedy tokens agree at {agree:.1%} of steps")
    record = {"config": dataclasses.asdict(cfg), "device": jax.devices()[0].device_kind,
              "backend": jax.default_backend(), "seed": args.seed, "repeats": args.repeats,
              "module": _registry.module_md5(),  # which build: the native module's md5
              "paged_path": path,
              "tokens_per_s": {name: cfg.batch * cfg.new / t for name, (_, t) in runs.items()},
              "logit_difference": worst, "largest_logit": scale, "agree": agree}
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    main()
