"""The metadata validator: each corruption is reported by name, on the host and in jit."""
import jax.numpy as jnp
import numpy as np
import pytest

from jax_msa_runner.config import RunnerConfig
from jax_msa_runner.batch.staging import stage_batch
from jax_msa_runner.batch.validate import MetadataInvariantError, validate_jit, validate_metadata

CFG = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, bucket_sizes=(4, 16),
                   max_model_len=512)


@pytest.fixture(scope="module")
def md():
    # rows: 3 tokens at 0..2, 1 token at 300, 5 tokens at 126..130; bucket (16, 4, 4)
    m = stage_batch([3, 1, 5], [0, 300, 126], [[7], [9, 4, 11], [5, 6]], CFG)
    validate_metadata(m, CFG)
    assert validate_jit(m, CFG).get() is None
    return m


def _set(md, name, index, value):
    return md.replace(**{name: getattr(md, name).at[index].set(value)})


CORRUPTIONS = [
    ("computed_negative", lambda m: _set(_set(m, "num_computed_tokens", 0, -1), "seq_lens", 0, 2),
     r"num_computed_tokens\[0\] = -1: must be >= 0"),
    ("seq_len_above_max", lambda m: _set(m, "seq_lens", 1, 600),
     r"seq_lens\[1\] = 600: exceeds max_model_len=512"),
    ("seq_len_below_query", lambda m: _set(m, "seq_lens", 2, 4),
     r"seq_lens\[2\] = 4: below num_scheduled_tokens = 5"),
    ("invariant1", lambda m: _set(m, "seq_lens", 1, 302),
     r"seq_lens\[1\] = 302: != num_computed 300 \+ num_scheduled 1 \(invariant 1\)"),
    ("req_mask", lambda m: _set(m, "req_mask", 3, True), r"req_mask\[3\] = True"),
    ("padded_row_lengths", lambda m: _set(_set(m, "num_computed_tokens", 3, 7), "seq_lens", 3, 7),
     r"padded row 3: num_computed_tokens = 7, seq_lens = 7, must be 0"),
    ("padded_row_block_table", lambda m: _set(m, "block_table", (3, 0), 2),
     r"block_table\[3, 0\] = 2"),
    ("null_page_in_sequence", lambda m: _set(m, "block_table", (2, 1), 0),
     r"block_table\[2, 1\] = 0: a real row needs non-null pages"),
    ("query_start_loc", lambda m: _set(m, "query_start_loc", 2, 5),
     r"query_start_loc\[1:1\+2\] = \(3, 5\)"),
    ("token_mask", lambda m: _set(m, "token_mask", 12, True), r"token_mask\[12\] = True"),
    ("req_indices", lambda m: _set(m, "req_indices", 4, 1), r"req_indices\[4\] = 1: expected 2"),
    ("query_pos", lambda m: _set(m, "query_pos", 5, 0), r"query_pos\[5\] = 0: expected 1"),
    ("kv_lens", lambda m: _set(m, "kv_lens", 3, 7), r"kv_lens\[3\] = 7: expected .* = 301"),
    ("stale_positions", lambda m: _set(_set(m, "positions", 3, 5), "num_valid_pages", 3, 1),
     r"selector/consumer page count mismatch at token 3"),
    ("stale_num_valid_pages", lambda m: _set(m, "num_valid_pages", 6, 1),
     r"selector/consumer page count mismatch at token 6"),
    ("invariant2", lambda m: _set(m, "positions", 3, 299),
     r"positions\[3\] = 299: expected num_computed 300 \+ query_pos 0 = 300"),
    ("padding_position", lambda m: _set(m, "positions", 10, 1), r"positions\[10\] = 1"),
    ("padding_num_valid_pages", lambda m: _set(m, "num_valid_pages", 10, 1),
     r"num_valid_pages\[10\] = 1: expected positions//128\+1 = 0"),
    ("slot_mapping", lambda m: _set(m, "slot_mapping", 0, 5), r"slot_mapping\[0\] = 5: expected 896"),
    ("padding_slot", lambda m: _set(m, "slot_mapping", 15, 0), r"slot_mapping\[15\] = 0: expected -1"),
]


@pytest.mark.parametrize("corrupt, match", [c[1:] for c in CORRUPTIONS],
                         ids=[c[0] for c in CORRUPTIONS])
def test_corruption_is_named(md, corrupt, match):
    bad = corrupt(md)
    with pytest.raises(MetadataInvariantError, match=match):
        validate_metadata(bad, CFG)
    err = validate_jit(bad, CFG)
    assert err.get() is not None
    with pytest.raises(MetadataInvariantError) as host_err:
        validate_metadata(bad, CFG)
    assert str(host_err.value) in err.get()  # same first failure inside jit


def test_position_past_block_table(md):
    bad = md.replace(seq_lens=md.seq_lens.at[0].set(600))
    cfg = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, bucket_sizes=(4, 16),
                       max_model_len=1024)
    bad = bad.replace(num_computed_tokens=bad.num_computed_tokens.at[0].set(597),
                      positions=bad.positions.at[:3].set(jnp.arange(597, 600)),
                      kv_lens=bad.kv_lens.at[:3].set(jnp.arange(598, 601)),
                      num_valid_pages=bad.num_valid_pages.at[:3].set(5),
                      block_table=bad.block_table.at[0, :4].set(7))
    with pytest.raises(MetadataInvariantError, match=r"positions\[0\] = 597: rank-local page 4 "
                                                     r"is outside the block table of 4 pages"):
        validate_metadata(bad, cfg)


def test_shape_mismatch(md):
    with pytest.raises(MetadataInvariantError, match=r"query_start_loc: shape \(4,\), expected \(5,\)"):
        validate_metadata(md.replace(query_start_loc=md.query_start_loc[:4]), CFG)
    with pytest.raises(MetadataInvariantError, match=r"kv_lens: shape \(15,\), expected \(16,\)"):
        validate_metadata(md.replace(kv_lens=md.kv_lens[:15]), CFG)


def test_host_numpy_metadata_accepted(md):
    """numpy-backed metadata is checked like device metadata: valid passes, corrupt fails."""
    host = md.replace(**{k: np.asarray(v) for k, v in md.items()})
    assert validate_metadata(host, CFG) is None
    bad = host.replace(positions=np.where(host.token_mask, host.positions + 1, 0))
    with pytest.raises(MetadataInvariantError, match="positions|page count"):
        validate_metadata(bad, CFG)
