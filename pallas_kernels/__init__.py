"""Pallas kernels for MiniMax-M3 MSA attention, each with its jax.numpy reference.

They know nothing of the runner: arrays in, arrays out.
"""
from pallas_kernels._shapes import PAGE_SIZE, TOPK
from pallas_kernels.index_scores import msa_index_scores, msa_index_scores_reference
from pallas_kernels.sparse_decode import sparse_decode, sparse_decode_reference
from pallas_kernels.sparse_decode_default import sparse_decode_default
from pallas_kernels.sparse_prefill import sparse_prefill, sparse_prefill_reference
from pallas_kernels.index_select import msa_index_select, msa_index_select_reference
from pallas_kernels.index_select_default import msa_index_select_default
from pallas_kernels.topk_select import sparse_topk_select, sparse_topk_select_reference

__all__ = [
    "PAGE_SIZE", "TOPK", "msa_index_scores", "msa_index_scores_reference",
    "sparse_topk_select", "sparse_topk_select_reference", "msa_index_select",
    "msa_index_select_reference", "msa_index_select_default", "sparse_decode",
    "sparse_decode_reference", "sparse_decode_default", "sparse_prefill",
    "sparse_prefill_reference",
]
