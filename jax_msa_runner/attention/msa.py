"""MSA attention for one batch: index scores -> top-16 page select -> sparse attention.

`msa_attention` wires the kernels (the indexer and select on the kernel
`msa_index_select_default` picks, decode on the one `sparse_decode_default` picks, each for
the batch's shape) to a batch's `BatchMetadata` (any object with the fields block_table,
req_indices, positions, num_valid_pages and kv_lens): the selector reads `num_valid_pages`
(derived from positions) and the attention reads `kv_lens` (derived from seq_lens); staging
guarantees they agree (validate.py checks it) and the attention kernel's safety boundary
makes a disagreement harmless anyway.

`msa_attention_reference` is the same pipeline on the pure jax.numpy references.
"""
from __future__ import annotations

import functools

import jax

from pallas_kernels.index_select import msa_index_select_reference
from pallas_kernels.index_select_default import msa_index_select_default
from pallas_kernels.sparse_decode import sparse_decode_reference
from pallas_kernels.sparse_decode_default import sparse_decode_default
from pallas_kernels.sparse_prefill import sparse_prefill


@functools.partial(jax.jit, static_argnames=("scale", "prefill", "interpret", "local_blocks",
                                             "init_blocks"))
def msa_attention(q, index_q, kv_cache, index_k_cache, md, *, scale, prefill=False,
                  interpret=None, local_blocks=1, init_blocks=0):
    """MSA attention of a padded batch.

    Args:
      q: [T, Hq, D] queries; index_q: [T, Hkv, Di] index queries (one index head per group).
      kv_cache: [N, Hkv, 128, 2D]; index_k_cache: [N, 128, Di] (same block table),
        index_q's dtype or float8_e4m3fn (upcast in the indexer).
      md: BatchMetadata (or any pytree with its field names) padded to T tokens.
      scale: softmax scale (static). prefill: use the prefill kernel, which shares page
        loads across consecutive tokens of a request (static). interpret: Pallas interpret
        mode (static); None: on every backend but a GPU.
      local_blocks, init_blocks: the selector's forced blocks (static;
        docs/DESIGN.md, "Selection").
    Returns:
      (out [T, Hq, D] q.dtype, lse [T, Hq] f32, selected [T, Hkv, 16] int32).
    """
    selected = msa_index_select_default(index_q, index_k_cache, md.block_table,
                                        md.req_indices, md.positions, md.num_valid_pages,
                                        local_blocks=local_blocks, init_blocks=init_blocks,
                                        interpret=interpret)
    attend = sparse_prefill if prefill else sparse_decode_default
    out, lse = attend(q, kv_cache, selected, md.block_table, md.req_indices, md.kv_lens,
                      scale=scale, interpret=interpret)
    return out, lse, selected


@functools.partial(jax.jit, static_argnames=("scale", "local_blocks", "init_blocks"))
def msa_attention_reference(q, index_q, kv_cache, index_k_cache, md, *, scale, local_blocks=1,
                            init_blocks=0):
    """`msa_attention` on the jax.numpy references (same arguments and results)."""
    selected = msa_index_select_reference(index_q, index_k_cache, md.block_table,
                                          md.req_indices, md.positions, md.num_valid_pages,
                                          local_blocks=local_blocks, init_blocks=init_blocks)
    out, lse = sparse_decode_reference(q, kv_cache, selected, md.block_table, md.req_indices,
                                       md.kv_lens, scale=scale)
    return out, lse, selected
