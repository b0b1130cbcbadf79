"""`BatchMetadata`: the padded, device-resident description of one step's batch.

Shapes use R = num_reqs_padded, T = num_tokens_padded, P = max_pages of the bucket.
All integer fields are int32, masks are bool. Field names are public API.
"""
from __future__ import annotations

import chex
import jax


@chex.dataclass(frozen=True)
class BatchMetadata:
    """One step's batch metadata, padded to a bucket (a pytree).

    Request rows (R):
      query_start_loc [R+1]  cumsum of num_scheduled_tokens, padded rows repeat the last offset
      seq_lens [R]           num_computed_tokens + num_scheduled_tokens (0 on padded rows)
      num_computed_tokens [R]
      num_scheduled_tokens [R]
      block_table [R, P]     physical page ids; padded rows / unused entries are 0 (null page)
      req_mask [R]           True on real rows
    Tokens (T):
      req_indices [T]        request row of the token (0 on padding)
      query_pos [T]          offset of the token inside its request's query (0 on padding)
      positions [T]          num_computed_tokens[req] + query_pos (0 on padding)
      slot_mapping [T]       block_table[r, pos // 128] * 128 + pos % 128; -1 = no write
      num_valid_pages [T]    positions // 128 + 1 on real tokens, 0 on padding (selector side)
      kv_lens [T]            seq_len - q_len + query_pos + 1 on real tokens, 0 on padding
                             (decode-consumer side: ceil(kv_lens / 128) == num_valid_pages)
      token_mask [T]         True on real tokens
    """

    query_start_loc: jax.Array
    seq_lens: jax.Array
    num_computed_tokens: jax.Array
    num_scheduled_tokens: jax.Array
    block_table: jax.Array
    req_indices: jax.Array
    query_pos: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    num_valid_pages: jax.Array
    kv_lens: jax.Array
    token_mask: jax.Array
    req_mask: jax.Array

    @property
    def num_tokens_padded(self) -> int:
        return self.positions.shape[0]

    @property
    def num_reqs_padded(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def max_pages(self) -> int:
        return self.block_table.shape[1]
