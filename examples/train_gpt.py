"""Train a small GPT on synthetic data, with jax_fa4, cuDNN or XLA attention.

    python examples/train_gpt.py --preset gpu --attention jax_fa4
    python examples/train_gpt.py --preset gpu --attention cudnn --json curves.jsonl
    python examples/train_gpt.py --preset gpu --attention jax_fa4 --shard data  # all GPUs
    python examples/train_gpt.py --preset gpu --attention jax_fa4 --shard seq   # ring
    python examples/train_gpt.py --preset cpu --attention xla               # < 1 min

The model: token embedding, pre-norm blocks (RMSNorm, causal grouped-query attention
with rotary position embeddings, SwiGLU MLP), final RMSNorm, untied LM head; fp32
parameters, bf16 matmuls and attention inputs, fp32 residual stream and loss. Only the
attention call differs between the --attention choices, and the seed fixes the
initialization and the data, so their loss curves and tokens/s compare directly.

The data is generated on the device at every step: a random walk on vocab states
(shown as tokens through a fixed random permutation) whose step size, one of STEP_SIZES
fixed random sizes, is kept from one position to the next with probability STICK and
otherwise drawn afresh. The current token alone leaves the step open (loss floor
ln STEP_SIZES); the token before it gives it away (a lower floor), so the loss only gets
below ln STEP_SIZES when attention works. Both floors are printed at startup.
"""

import argparse
import dataclasses
import functools
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_fa4

STEP_SIZES = 4
STICK = 0.9
ATTENTIONS = ("jax_fa4", "cudnn", "xla")
PRESETS = {
    "gpu": {"layers": 8, "width": 1024, "heads": 16, "kv_heads": 4, "seq": 8192,
            "batch": 1, "steps": 300, "lr": 1e-3, "vocab": 512},
    "cpu": {"layers": 2, "width": 128, "heads": 4, "kv_heads": 2, "seq": 128,
            "batch": 4, "steps": 30, "lr": 1e-2, "vocab": 64},
}


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int
    width: int
    heads: int
    kv_heads: int
    seq: int
    batch: int
    steps: int
    lr: float
    vocab: int
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


def rope(x, base=10000.0):
    """x (B, S, H, D) -> x with the feature pairs (i, i + D/2) of position s rotated by
    the angle s * base^(-2i/D); computed in fp32, returned in x's dtype."""
    seq, dim = x.shape[1], x.shape[-1]
    angle = jnp.arange(seq)[:, None] * base ** (-jnp.arange(dim // 2) * 2 / dim)
    cos, sin = jnp.cos(angle)[:, None], jnp.sin(angle)[:, None]  # (S, 1, D/2)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, cfg: Config, attend, rngs: nnx.Rngs):
        dense = {"use_bias": False, "dtype": jnp.bfloat16, "rngs": rngs}
        # SwiGLU's hidden width: 2/3 of the usual 4 * width, rounded up to 256.
        hidden = 256 * math.ceil(8 * cfg.width / 3 / 256)
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.attend = attend
        self.attn_norm = nnx.RMSNorm(cfg.width, dtype=jnp.bfloat16, rngs=rngs)
        self.qkv = nnx.Linear(cfg.width, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim,
                              **dense)
        self.attn_out = nnx.Linear(cfg.heads * cfg.head_dim, cfg.width, **dense)
        self.mlp_norm = nnx.RMSNorm(cfg.width, dtype=jnp.bfloat16, rngs=rngs)
        self.gate_up = nnx.Linear(cfg.width, 2 * hidden, **dense)
        self.down = nnx.Linear(hidden, cfg.width, **dense)

    def __call__(self, x):
        """x (B, S, width) fp32 -> (B, S, width) fp32."""
        b, s, _ = x.shape
        d = self.head_dim
        q, k, v = jnp.split(self.qkv(self.attn_norm(x)),
                            [self.heads * d, (self.heads + self.kv_heads) * d], axis=-1)
        q = rope(q.reshape(b, s, self.heads, d))
        k = rope(k.reshape(b, s, self.kv_heads, d))
        out = self.attend(q, k, v.reshape(b, s, self.kv_heads, d))
        x = x + self.attn_out(out.reshape(b, s, self.heads * d))
        gate, up = jnp.split(self.gate_up(self.mlp_norm(x)), 2, axis=-1)
        return x + self.down(nnx.silu(gate) * up)


class GPT(nnx.Module):
    def __init__(self, cfg: Config, attend, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, attend, rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.width, dtype=jnp.bfloat16, rngs=rngs)
        self.head = nnx.Linear(cfg.width, cfg.vocab, use_bias=False, dtype=jnp.bfloat16,
                               rngs=rngs)

    def __call__(self, tokens):
        """tokens (B, S) int32 -> logits (B, S, vocab) fp32."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).astype(jnp.float32)


def make_attention(name: str, cfg: Config, operand_sharding=None):
    """-> (attend, description of its path);
    attend(q (B, S, Hq, D), k (B, S, Hkv, D), v (B, S, Hkv, D)) -> (B, S, Hq, D).
    operand_sharding: where q, k, v are placed before the call (--shard seq: split
    along the sequence, so jax_fa4 runs ring attention across the devices)."""
    def place(*xs):
        if operand_sharding is None:
            return xs
        return tuple(jax.lax.with_sharding_constraint(x, operand_sharding) for x in xs)

    if name != "jax_fa4":
        def attend(q, k, v):  # jax.nn takes GQA natively: k, v keep their Hkv heads
            return jax.nn.dot_product_attention(*place(q, k, v), is_causal=True,
                                                implementation=name)
        return attend, f"jax.nn.dot_product_attention(implementation={name!r})"

    def attend(q, k, v):
        return jax_fa4.attention(*place(q, k, v), causal=True)

    q, kv = (jax.ShapeDtypeStruct((cfg.batch, cfg.seq, h, cfg.head_dim), jnp.bfloat16)
             for h in (cfg.heads, cfg.kv_heads))
    kernel, reason = jax_fa4.supports(q, kv, kv, causal=True)
    path = "CuTe-DSL kernel" if kernel else f"pure-JAX reference ({reason})"
    return attend, f"jax_fa4.attention -> {path}"


def make_walk(key, vocab):
    """-> (perm (vocab,): state -> token, sizes (STEP_SIZES,): distinct steps)."""
    k_perm, k_sizes = jax.random.split(key)
    sizes = 1 + jax.random.choice(k_sizes, vocab - 1, (STEP_SIZES,), replace=False)
    return jax.random.permutation(k_perm, vocab), sizes


def sample(key, perm, sizes, batch, length):
    """-> tokens (batch, length) int32 of the walk (module docstring), each row from a
    uniformly random start."""
    k_start, k_redraw, k_size = jax.random.split(key, 3)
    redraw = jax.random.bernoulli(k_redraw, 1 - STICK, (batch, length))
    redraw = redraw.at[:, 0].set(True)
    drawn = jax.random.randint(k_size, (batch, length), 0, STEP_SIZES)
    # Each position keeps the size drawn at the last redraw at or before it.
    last = jax.lax.cummax(jnp.where(redraw, jnp.arange(length), 0), axis=1)
    step = sizes[jnp.take_along_axis(drawn, last, axis=1)]
    start = jax.random.randint(k_start, (batch, 1), 0, perm.size)
    return perm[(start + jnp.cumsum(step, axis=1)) % perm.size]


def loss_floors() -> tuple[float, float]:
    """Best mean cross-entropy per token: seeing the current token only (the step
    size is unknown: uniform), and seeing the one before too (the size sticks, or is
    redrawn)."""
    stay = STICK + (1 - STICK) / STEP_SIZES
    move = (1 - STICK) / STEP_SIZES
    return math.log(STEP_SIZES), -(stay * math.log(stay)
                                   + (STEP_SIZES - 1) * move * math.log(move))


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=PRESETS,
                    help="default: gpu on a GPU backend, else cpu")
    ap.add_argument("--attention", choices=ATTENTIONS, default="jax_fa4")
    for name, kind in (("layers", int), ("width", int), ("heads", int),
                       ("kv-heads", int), ("seq", int), ("batch", int), ("steps", int),
                       ("lr", float), ("vocab", int)):
        ap.add_argument(f"--{name}", type=kind, help="overrides the preset")
    ap.add_argument("--seed", type=int, default=0, help="initialization and data")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--shard", choices=("data", "seq"),
                    help="over all local devices, params replicated: data splits the "
                         "batch, seq splits every sequence, the layers running on each "
                         "device's chunk (jax_fa4 then runs ring attention)")
    ap.add_argument("--json", help="append a JSON record of the run to this file")
    args = ap.parse_args(argv)
    if args.preset is None:
        args.preset = "gpu" if jax.default_backend() == "gpu" else "cpu"
    overrides = {k: v for k, v in vars(args).items()
                 if k in PRESETS[args.preset] and v is not None}
    cfg = Config(**{**PRESETS[args.preset], **overrides}, seed=args.seed)
    small = [name for name, value in {**overrides, "log_every": args.log_every}.items()
             if value <= 0]
    if small:
        ap.error(f"sizes, --lr and --log-every must be > 0; not so: {', '.join(small)}")
    if not math.isfinite(cfg.lr):
        ap.error(f"--lr must be finite; got {cfg.lr}")
    if cfg.vocab <= STEP_SIZES:
        ap.error(f"--vocab must be above {STEP_SIZES}: the synthetic text's walk takes "
                 f"{STEP_SIZES} distinct step sizes below it; got {cfg.vocab}")
    if cfg.steps < 2:
        ap.error("--steps must be at least 2 (the first step compiles)")
    if cfg.width % cfg.heads or cfg.heads % cfg.kv_heads or cfg.head_dim % 2:
        ap.error("heads must divide width (into an even head_dim); kv-heads must "
                 "divide heads")
    devices = jax.local_devices() if args.shard else jax.local_devices()[:1]
    if args.shard == "data" and cfg.batch % len(devices):
        ap.error(f"--shard data: batch {cfg.batch} must divide over {len(devices)} devices")
    if args.shard == "seq" and cfg.seq % len(devices):
        ap.error(f"--shard seq: seq {cfg.seq} must divide over {len(devices)} devices")
    if args.attention == "cudnn" and devices[0].platform != "gpu":
        ap.error("--attention cudnn needs a GPU")
    return args, cfg, devices


def main(argv=None) -> dict:
    """Trains; returns the record that --json appends."""
    args, cfg, devices = parse(argv)
    # A 1-D mesh even for one device: the same code runs sharded or not.
    mesh = Mesh(np.array(devices), ("devices",))
    replicated = NamedSharding(mesh, PartitionSpec())
    by_seq = args.shard == "seq"
    # Data parallel splits the batch of tokens. Sequence parallel splits every sequence:
    # inputs and targets in chunks (loss_fn), so the per-token layers run on each
    # device's chunk and only attention crosses devices (jax_fa4: the ring).
    batch_sharding = replicated if by_seq else NamedSharding(mesh, PartitionSpec("devices"))
    seq_sharding = NamedSharding(mesh, PartitionSpec(None, "devices")) if by_seq else None

    attend, path = make_attention(args.attention, cfg, seq_sharding)
    k_init, k_walk, k_data = jax.random.split(jax.random.key(cfg.seed), 3)
    graphdef, params = nnx.split(GPT(cfg, attend, nnx.Rngs(k_init)), nnx.Param)
    warmup = max(1, cfg.steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, cfg.steps,
                                                  end_value=cfg.lr / 10)
    # Weight decay on matrices only, not on norm scales.
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1,
                                 mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)))
    state = jax.device_put((params, tx.init(params)), replicated)

    perm, sizes = make_walk(k_walk, cfg.vocab)
    # seq + 1 tokens: inputs are the first seq, targets the last seq.
    make_batch = jax.jit(
        lambda step: sample(jax.random.fold_in(k_data, step), perm, sizes, cfg.batch,
                            cfg.seq + 1),
        out_shardings=batch_sharding)

    def loss_fn(params, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if by_seq:
            inputs, targets = (jax.lax.with_sharding_constraint(x, seq_sharding)
                               for x in (inputs, targets))
        logits = nnx.merge(graphdef, params)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @functools.partial(jax.jit, donate_argnums=0, out_shardings=replicated)
    def train_step(state, tokens):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    n_params = sum(x.size for x in jax.tree.leaves(params))
    tokens_per_step = cfg.batch * cfg.seq
    print(f"config: preset={args.preset} {dataclasses.asdict(cfg)} "
          f"head_dim={cfg.head_dim} params={n_params / 1e6:.2f}M "
          f"tokens/step={tokens_per_step}")
    sharding = ("" if args.shard is None else f", {args.shard} sharded"
                + (" (one device: nothing to split)" if len(devices) == 1 else ""))
    print(f"device: {len(devices)} x {devices[0].device_kind} ({devices[0].platform})"
          f"{sharding}")
    print(f"attention: {args.attention}: {path}")
    print("data: sticky random walk; loss floors {:.3f} (current token only), "
          "{:.3f} (with the token before)".format(*loss_floors()))

    skip = max(1, cfg.steps // 10)  # the first steps, left out of the mean tokens/s
    t0 = time.perf_counter()
    state, loss = train_step(state, make_batch(1))
    loss = float(loss)  # waits for the step: the times below leave compilation out
    last_step, last_time = 1, time.perf_counter()
    print(f"step 1 loss {loss:.4f} (compile and first step {last_time - t0:.1f} s)")
    # tokens/s per logged step (none for the first: it compiles).
    logged, rates, skip_time = [(1, loss)], [None], last_time
    for step in range(2, cfg.steps + 1):
        state, loss = train_step(state, make_batch(step))
        log = step % args.log_every == 0 or step == cfg.steps
        if not (log or step == skip):
            continue
        loss = float(loss)  # waits for the step
        now = time.perf_counter()
        if step == skip:
            skip_time = now
        if log:
            if not math.isfinite(loss):
                raise SystemExit(f"loss is {loss} at step {step}")
            rate = tokens_per_step * (step - last_step) / (now - last_time)
            logged.append((step, loss))
            rates.append(rate)
            print(f"step {step} loss {loss:.4f} tokens/s {rate:.0f}")
        last_step, last_time = step, now
    mean_rate = tokens_per_step * (cfg.steps - skip) / (last_time - skip_time)
    print(f"final: attention={args.attention} loss={loss:.4f} "
          f"mean tokens/s={mean_rate:.0f}")

    record = {"attention": args.attention, "path": path, "preset": args.preset,
              "config": dataclasses.asdict(cfg), "shard": args.shard, "devices": len(devices),
              "device": devices[0].device_kind, "steps": [s for s, _ in logged],
              "losses": [x for _, x in logged], "tokens_per_s": rates,
              "mean_tokens_per_s": mean_rate, "final_loss": loss}
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    main()
