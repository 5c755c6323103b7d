"""What the JAX spoke (``neuraldbg.jax``) traces into a compiled train step: the parameters'
sums of squares and the ring buffer's update. Needs jax only (not optax, not Keras), so that a
Keras spoke on the JAX backend can import it too (``neuraldbg.keras`` does not yet: its version
with these measured slower, see BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Any, Dict, List

import jax
import jax.numpy as jnp
import numpy as np

# Leaves of up to this many elements are reduced together; larger ones alone (copying them
# together would cost more than their own reductions' launches: a 256x256 kernel already does,
# BENCHMARKS.md "JAX and Keras").
SMALL_LEAF = 1 << 14
# The most entries of the constant 0/1 matrix that adds the small leaves' rows up per leaf.
SEGMENT_ENTRIES = 1 << 16


def as_f32(i: Any) -> Any:
    """An int32 as the float32 of the same bits (how a ring buffer holds steps and counts)."""
    return jax.lax.bitcast_convert_type(jnp.asarray(i, jnp.int32), jnp.float32)


def as_i32(f: Any) -> Any:
    return jax.lax.bitcast_convert_type(f, jnp.int32)


def squares(leaves: List[Any], where: List[int]) -> Any:
    """Each spec parameter's sum of squares (f32), in spec order (``where[j]``: the index of
    parameter ``j``'s leaf, -1 where absent, which gets -1): the host takes the square roots,
    which would be one more kernel in the step. The small leaves are laid end to end as the rows
    of one matrix (each padded with zeros to whole rows), and the rows' sums of squares are
    added up per parameter by one product with a constant 0/1 matrix: three kernels for all of
    them, where a reduction per leaf costs its launch, more than its arithmetic, on a small
    step. Rows are 64 wide, wider when the 0/1 matrix would otherwise pass
    :data:`SEGMENT_ENTRIES` (many small leaves, many rows)."""
    flat = [jnp.ravel(jnp.asarray(leaf)).astype(jnp.float32) for leaf in leaves]
    sizes = [int(v.shape[0]) for v in flat]
    small = [i for i, size in enumerate(sizes) if size <= SMALL_LEAF]
    # In each parameter's place: a large leaf's own sum, -1 for an absent one, else 0 (plus
    # the small leaves' sums below).
    out = jnp.stack(
        [
            jnp.sum(jnp.square(flat[i])) if i >= 0 and sizes[i] > SMALL_LEAF else jnp.float32(0.0 if i >= 0 else -1.0)
            for i in where
        ]
    )
    if small:
        width = 64
        while width < SMALL_LEAF and len(where) * sum(-(-sizes[i] // width) for i in small) > SEGMENT_ENTRIES:
            width *= 2
        spans = {i: -(-sizes[i] // width) for i in small}
        block = jnp.concatenate([jnp.pad(flat[i], (0, spans[i] * width - sizes[i])) for i in small])
        rows = jnp.sum(jnp.square(block.reshape(-1, width)), axis=1)
        # segment[j, r] = 1: row r holds part of spec parameter j's leaf.
        first = dict(zip(small, np.cumsum([0] + [spans[i] for i in small])))
        segment = np.zeros((len(where), int(rows.shape[0])), np.float32)
        for j, i in enumerate(where):
            if i in spans:
                segment[j, first[i] : first[i] + spans[i]] = 1.0
        out = out + jnp.asarray(segment) @ rows
    return out


def write_row(buf: Any, at: Any, row: Any, last: Dict[int, Any]) -> Any:
    """A ring buffer (``[rows + 1, width]``) with ``row`` in row ``at`` and, in its last row,
    the cells ``last`` names (column: float32 scalar), by one select over the whole buffer: one
    kernel where in-place updates take one each. A state that is not donated is copied anyway,
    and the select is that copy; a donated one is written in place, provided nothing in the
    select reads the buffer at another place (the row and the counts come from elsewhere)."""
    at_row = jax.lax.broadcasted_iota(jnp.int32, buf.shape, 0)
    at_col = jax.lax.broadcasted_iota(jnp.int32, buf.shape, 1)
    buf = jnp.where(at_row == at, row[None, :], buf)
    tail = at_row == buf.shape[0] - 1
    for col, value in last.items():
        buf = jnp.where(tail & (at_col == col), value, buf)
    return buf
