"""The hashing trick: any id -> one of m shared rows (Weinberger et al. 2009, "Feature Hashing for Large Scale
Multitask Learning"), optionally with a sign hash.

Hash functions (`options.hash`):
  - "universal" (default): Carter & Wegman (1979) h(x) = ((a * x + b) mod p) mod m with the Mersenne prime
    p = 2^31 - 1 and a in [1, p), b in [0, p) drawn from (seed, table name). The family is universal on [0, p):
    two distinct ids collide with probability ~1/m over the draw of (a, b). The arithmetic is exact on uint32
    inside jit -- no 64-bit types, nothing enabled globally: a * x < 2^62 is split into 16-bit limbs and
    reduced with 2^31 = 1 (mod p) (`_mulmod_p`). Ids are first reduced mod p, so the one non-negative int32
    id >= p, 2^31 - 1, shares its row with id 0 for every draw; a negative id is hashed by its uint32 bit
    pattern.
  - "modulo": h(x) = x mod m (jnp.remainder, non-negative for any int32 id). Not universal: ids in a
    structured range (e.g. all multiples of m) collide deterministically.

Sign hash (`options.sign`): Weinberger et al.'s xi(x) in {+1, -1} from a second, independent universal hash
(parity of ((a' x + b') mod p)); the embedding of x is xi(x) * W[h(x)], so ids that share a row get opposite
signs half of the time. The sign must multiply each id's row *before* pooling, and a combine sees rows, never
ids. So the sign is routed like a row: a second physical table `<name>/sign` f32[1, 1] that ids with
xi = +1 route to (row 0) and ids with xi = -1 do not (row -1 reads zeros, see `EmbeddingMethod.route`). The
combine reads "is the sign row present" -- a comparison, so its gradient is exactly zero, which leaves the row
untouched by every sparse optimizer (SGD, (row-wise) Adagrad and lazy Adam all move a row by 0 for a zero
gradient from zero state) -- and multiplies the main row by +1 or -1. The sign is per id, so pooling must
follow the combine (`pools_before_combine = False`). Cost: 4 bytes and one extra dedup'd gather per bag slot.
(The row is initialised U(-1, 1); a draw of exactly 0.0 -- probability ~2^-24 -- would make every sign -1,
which is the unsigned trick up to a global sign, so even that failure is benign.)
"""

import math
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from compression.base import EmbeddingMethod, PhysicalTable, TableSpec, dlrm_init_scale, method_options
from compression.full import FirstRows

MERSENNE_P = (1 << 31) - 1  # the prime of the universal family
HASHES = ("universal", "modulo")
_MASK16 = 0xFFFF
_MASK15 = 0x7FFF


def _reduce_p(s: jax.Array) -> jax.Array:
    """s mod p for uint32 s (any value < 2^32), using 2^31 = 1 (mod p); the result is < p."""
    s = (s & MERSENNE_P) + (s >> 31)  # <= p + 1
    return jnp.where(s >= MERSENNE_P, s - MERSENNE_P, s)


def _mulmod_p(a: int, x: jax.Array) -> jax.Array:
    """(a * x) mod p exactly, for a constant a < p and uint32 x < p, with uint32 arithmetic only.

    a * x = a1 x1 2^32 + (a1 x0 + a0 x1) 2^16 + a0 x0 with 16-bit limbs (a1, x1 < 2^15); every partial product
    fits in 32 bits, and 2^32 = 2, mid * 2^16 = (mid >> 15) 2^31 + (mid & 0x7fff) 2^16 = (mid >> 15) +
    (mid & 0x7fff) 2^16 (mod p).
    """
    a1, a0 = jnp.uint32(a >> 16), jnp.uint32(a & _MASK16)
    x1, x0 = x >> 16, x & _MASK16
    high = (a1 * x1) << 1  # < 2^31
    mid = a1 * x0 + a0 * x1  # < 2^32
    mid = (mid >> 15) + ((mid & _MASK15) << 16)  # < 2^31 + 2^17
    low = a0 * x0  # < 2^32
    return _reduce_p(_reduce_p(high + _reduce_p(mid)) + _reduce_p(low))


def universal_hash(ids: jax.Array, a: int, b: int, buckets: int) -> jax.Array:
    """((a * x + b) mod p) mod buckets for int32 ids (taken as uint32), exact; i32[...] in [0, buckets)."""
    if not (1 <= a < MERSENNE_P and 0 <= b < MERSENNE_P and 1 <= buckets < 2**31):
        raise ValueError(f"universal hash needs 1 <= a < p, 0 <= b < p, 1 <= buckets < 2^31; got {a}, {b}, {buckets}")
    x = _reduce_p(ids.astype(jnp.uint32))
    h = _reduce_p(_mulmod_p(a, x) + jnp.uint32(b))
    return (h % jnp.uint32(buckets)).astype(jnp.int32)


def universal_hash_params(seed: int, name: str, salt: int) -> tuple[int, int]:
    """(a, b) of one member of the family, a pure function of (seed, table name, salt)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), salt])
    return int(rng.integers(1, MERSENNE_P)), int(rng.integers(0, MERSENNE_P))


class SignedRows(nn.Module):
    """Combine of a signed hashed table: rows f32[..., D] times +1 where the sign row is present, else -1."""

    @nn.compact
    def __call__(self, rows: tuple[jax.Array, ...]) -> jax.Array:
        table_rows, sign_rows = rows  # f32[..., D], f32[..., 1]
        sign = jnp.where(jax.lax.stop_gradient(sign_rows) != 0, 1.0, -1.0)
        return table_rows * sign


class HashingEmbedding(EmbeddingMethod):
    """f32[m, dim] shared by every id through h(x); any non-negative int32 id is valid input.

    Options: buckets (m) or collisions (m = ceil(vocab_size / collisions)), hash ("universal" | "modulo"),
    seed (draws the universal hash), sign (bool: Weinberger's sign hash, see the module docstring).
    """

    accepts_any_id = True

    def __init__(self, spec: TableSpec):
        super().__init__(spec)
        opts = method_options(spec, {"buckets": 0, "collisions": 0.0, "hash": "universal", "seed": 0,
                                     "sign": False})
        buckets, collisions = int(opts["buckets"]), float(opts["collisions"])
        if (buckets > 0) == (collisions > 0):
            raise ValueError(f"table '{spec.name}': hashing needs exactly one of options.buckets (rows, >= 1) or "
                             f"options.collisions (ids per row, >= 1); got buckets={opts['buckets']}, "
                             f"collisions={opts['collisions']}")
        if collisions and collisions < 1:
            raise ValueError(f"table '{spec.name}': hashing collisions must be >= 1 (ids per row), got {collisions}")
        self.buckets = buckets or math.ceil(spec.vocab_size / collisions)
        if not 1 <= self.buckets < 2**31:
            raise ValueError(f"table '{spec.name}': hashing needs 1 <= buckets < 2^31, got {self.buckets}")
        if opts["hash"] not in HASHES:
            raise ValueError(f"table '{spec.name}': unknown hash '{opts['hash']}'; use one of {HASHES}")
        self.hash = opts["hash"]
        self.sign = bool(opts["sign"])
        self.seed = int(opts["seed"])
        self.hash_params = universal_hash_params(self.seed, spec.name, salt=0)
        self.sign_params = universal_hash_params(self.seed, spec.name, salt=1)
        self.pools_before_combine = not self.sign  # the sign multiplies each id's row before pooling

    def physical_tables(self) -> tuple[PhysicalTable, ...]:
        spec = self.spec
        tables = (PhysicalTable(spec.name, self.buckets, spec.dim, dlrm_init_scale(self.buckets)),)
        if self.sign:
            tables += (PhysicalTable(f"{spec.name}/sign", 1, 1, 1.0),)
        return tables

    def bucket(self, ids: jax.Array) -> jax.Array:
        """i32[...] -> the row h(x) in [0, buckets)."""
        if self.hash == "modulo":
            return jnp.remainder(ids.astype(jnp.int32), self.buckets)
        return universal_hash(ids, *self.hash_params, self.buckets)

    def signs(self, ids: jax.Array) -> jax.Array:
        """i32[...] -> xi(x) in {+1, -1} (i32), the parity of a second universal hash."""
        return 1 - 2 * universal_hash(ids, *self.sign_params, 2)

    def route(self, ids: jax.Array) -> tuple[jax.Array, ...]:
        rows = self.bucket(ids)
        if not self.sign:
            return (rows,)
        return rows, jnp.where(self.signs(ids) > 0, 0, -1)

    def combine_module(self, name: str) -> nn.Module:
        return SignedRows(name=name) if self.sign else FirstRows(name=name)
