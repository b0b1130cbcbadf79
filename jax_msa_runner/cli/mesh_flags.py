"""The ``--tp N --ep M`` flags of ``serve``, ``demo`` and ``logits``: registration, checks
against the model before any work starts, and a checkpoint load straight onto the shards.

On CPU the ranks are host devices (the apps call ``demo.request_host_devices`` first). A
bad value raises ``flags.FlagError`` naming the flag and the bound.
"""
from __future__ import annotations

from jax_msa_runner.config import ConfigError, ModelConfig
from jax_msa_runner.cli.flags import FlagError, bounded_int

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def add_mesh_args(group) -> None:
    """Register ``--tp`` and ``--ep`` (each an int >= 1, default 1) on a parser or group."""
    group.add_argument("--tp", type=bounded_int(1), default=1, metavar="N",
                       help="tensor-parallel ranks: attention heads, MLP intermediate sizes and "
                            "the vocabulary split over N devices")
    group.add_argument("--ep", type=bounded_int(1), default=1, metavar="M",
                       help="expert-parallel ranks: the routed experts split over M devices")


def add_distributed_args(group) -> None:
    """Register ``--coordinator HOST:PORT --num-processes N --process-id I`` (all or none):
    one process per host, joined by ``jax.distributed.initialize``."""
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="multi-process run: address of process 0's coordinator")
    group.add_argument("--num-processes", type=bounded_int(1), default=None, metavar="N",
                       help="multi-process run: number of processes (one per host)")
    group.add_argument("--process-id", type=bounded_int(0), default=None, metavar="I",
                       help="multi-process run: this process's index in [0, N)")


def init_distributed(args) -> None:
    """``jax.distributed.initialize`` from the flags of ``add_distributed_args`` (nothing
    when none is given; gloo collectives on CPU). Must run before jax touches a device.
    FlagError naming the flag unless all three are given and process id < N."""
    given = [args.coordinator is not None, args.num_processes is not None,
             args.process_id is not None]
    if not any(given):
        return
    if not all(given):
        raise FlagError("--coordinator/--num-processes/--process-id",
                        "give all three for a multi-process run, or none")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise FlagError("--coordinator", f"must be HOST:PORT with a port in [1, 65535], got "
                                         f"{args.coordinator!r}")
    if args.process_id >= args.num_processes:
        raise FlagError("--process-id", f"must be in [0, --num-processes={args.num_processes}), "
                                        f"got {args.process_id}")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id)


def check_mesh_flags(mconfig: ModelConfig, tp: int, ep: int, dcp: int = 1) -> None:
    """FlagError (``--tp`` / ``--ep``) unless the mesh fits the model and the devices."""
    from jax_msa_runner.attention.parallel import check_mesh_shape

    try:
        check_mesh_shape(mconfig, dcp, tp, ep)
    except ConfigError as e:
        msg = str(e)
        if msg.startswith("ep_size: "):
            raise FlagError("--ep", msg[len("ep_size: "):]) from None
        if "ranks need" in msg:
            raise FlagError("--tp/--ep", msg[len("tp_size: "):] + " (on CPU: XLA_FLAGS="
                            f"{HOST_DEVICES_FLAG}=N before jax starts)") from None
        raise FlagError("--tp", msg[len("tp_size: "):]) from None


def load_checkpoint_sharded(path: str, *, dtype: str, num_layers: int | None, tp: int, ep: int,
                            dcp: int = 1):
    """``checkpoint.load`` with every weight placed straight onto its shards of the
    (dcp, tp, ep) mesh (one device without TP/EP). Returns (ModelConfig, params).
    Raises CheckpointError / ConfigError / OSError from the loader, FlagError from the
    mesh checks (made on the checkpoint's config.json before any weight is read)."""
    from jax_msa_runner.checkpoint import load

    if tp * ep == 1:
        return load(path, dtype=dtype, num_layers=num_layers)
    from jax_msa_runner.attention.parallel import model_mesh, param_putter

    mc = ModelConfig.from_hf_config(path, num_layers=num_layers, dtype=dtype)
    check_mesh_flags(mc, tp, ep, dcp)
    return load(path, dtype=dtype, num_layers=num_layers,
                put=param_putter(model_mesh(dcp, tp, ep)))


__all__ = ["HOST_DEVICES_FLAG", "add_mesh_args", "add_distributed_args", "init_distributed", "check_mesh_flags", "load_checkpoint_sharded"]
