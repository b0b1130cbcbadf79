"""Pallas (Triton backend) kernels for MiniMax-M3 MSA attention, each with its jnp reference."""
from pallas_kernels.index_scores import msa_index_scores, msa_index_scores_reference
from pallas_kernels.msa_attention import msa_attention, msa_attention_reference
from pallas_kernels.sparse_decode import sparse_decode, sparse_decode_reference
from pallas_kernels.sparse_prefill import sparse_prefill, sparse_prefill_reference
from pallas_kernels.topk_select import sparse_topk_select, sparse_topk_select_reference

__all__ = [
    "msa_index_scores", "msa_index_scores_reference", "sparse_topk_select",
    "sparse_topk_select_reference", "sparse_decode", "sparse_decode_reference",
    "sparse_prefill", "sparse_prefill_reference", "msa_attention", "msa_attention_reference",
]
