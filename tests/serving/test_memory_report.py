"""The start-up memory report: bytes per dtype on the busiest device, page bytes, pages that
fit under a device limit."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_msa_runner.serving.memory_report import MemoryReport, memory_report
from pallas_kernels.fp8_matmul import Fp8Weight

MiB = 2 ** 20


def test_counts_bytes_by_dtype_and_pages_that_fit():
    params = {"w": Fp8Weight(jnp.zeros((4 * MiB,), jnp.float8_e4m3fn),
                             jnp.zeros((MiB // 8,), jnp.uint8)),
              "embed": jnp.zeros((MiB,), jnp.bfloat16)}
    caches = (jnp.zeros((10, MiB // 4), jnp.float32),)  # 10 pages of 1 MiB
    rep = memory_report(params, caches, 10, step_temp_bytes=3 * MiB,
                        device_limit_bytes=100 * MiB)
    assert rep.weights_by_dtype == {"float8_e4m3fn": 4 * MiB, "bfloat16": 2 * MiB,
                                    "uint8": MiB // 8}
    assert list(rep.weights_by_dtype) == ["float8_e4m3fn", "bfloat16", "uint8"]
    assert rep.page_bytes == MiB and rep.cache_bytes == 10 * MiB
    assert rep.pages_that_fit == (100 * MiB - 6 * MiB - MiB // 8 - 3 * MiB) // MiB == 90
    lines = rep.lines()
    assert lines[0] == "memory: weights 6.1 MiB (float8_e4m3fn 4.0, bfloat16 2.0, uint8 0.1 MiB)"
    assert lines[1].startswith("memory: KV cache 10 pages x 1.000 MiB = 10.0 MiB; 90 pages fit")
    unknown = memory_report(params, caches, 10)
    assert unknown.pages_that_fit is None
    assert unknown.lines()[1].endswith("device memory limit unknown on this backend")


def test_sharded_params_count_one_device_shard():
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    w = jax.device_put(jnp.zeros((8, MiB), jnp.bfloat16), NamedSharding(mesh, P("tensor")))
    caches = jax.device_put(jnp.zeros((4, MiB), jnp.float32), NamedSharding(mesh, P()))
    rep = memory_report({"w": w}, caches, 4)
    assert rep.num_devices == 2 and rep.weights_by_dtype == {"bfloat16": 8 * MiB}
    assert rep.page_bytes == 4 * MiB
    assert rep.lines()[0].startswith("memory per device: weights 8.0 MiB")


def test_a_full_device_fits_no_pages():
    rep = MemoryReport(num_devices=1, weights_by_dtype={"bfloat16": 10}, cache_bytes=8,
                       num_pages=2, step_temp_bytes=5, device_limit_bytes=12)
    assert rep.pages_that_fit == 0
