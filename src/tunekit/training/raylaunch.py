"""training.ray: the recipe as a Ray Train job. The driver (`tunekit train` here) connects to the cluster, checks
that it can give every worker its resources, and runs a TorchTrainer whose workers each run tunekit's own training
in the process group Ray sets up (gloo on CPUs, NCCL on GPUs), as under torchrun. Ray Train does the scheduling,
the process group and the restarts after a failure (FailureConfig); what it would do badly here is handled
before: a request the cluster cannot meet would wait for ever (its worker-group start timeout is retried without
limit by default), workers would run in Ray's session folder (relative paths break), and its checkpoints would be
copies. The run directory is Ray's experiment folder: tunekit's checkpoints are registered where they lie, and
Ray's few files in it (RAY_FILES) survive a restart's new start of the run."""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path
from typing import Callable

from tunekit.config.trainingschema import RayConfig
from tunekit.core.errors import TunekitError, first_line

log = logging.getLogger("tunekit")
# Ray Train's bookkeeping in the run directory (its experiment folder): its storage marker, its list of reported
# checkpoints and its NCCL hang records
RAY_FILES = (".validate_storage_marker", "checkpoint_manager_snapshot.json", "hang_detector")


def forget(run_dir: Path) -> None:
    """Remove Ray's bookkeeping of an earlier run in this directory: a new fit would restore its checkpoint list
    (and refuse it where tunekit had rotated checkpoints away). tunekit resumes from its own checkpoints."""
    for name in RAY_FILES:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def run_dir_of(output_dir: str | Path, ray: RayConfig) -> Path:
    """The run directory: output_dir, or STORAGE/<its name> with training.ray.storage."""
    out = Path(output_dir)
    return (Path(ray.storage).expanduser() / out.name).absolute() if ray.storage else out.absolute()


def import_ray():
    try:
        import ray
        import ray.train  # noqa: F401  (the extra: ray[train])
    except ImportError:
        raise TunekitError("training.ray needs Ray Train, which is not installed; pip install 'tunekit[ray]' (or "
                           "remove training.ray to train in this process)") from None
    return ray


def _describe(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def per_worker(ray_cfg: RayConfig, cluster: dict[str, float]) -> dict[str, float]:
    """resources_per_worker, or one GPU (and one CPU) per worker where the cluster has GPUs, else one CPU."""
    if ray_cfg.resources_per_worker is not None:
        return {k: v for k, v in ray_cfg.resources_per_worker.items() if v > 0}
    return {"CPU": 1.0, "GPU": 1.0} if cluster.get("GPU", 0) >= 1 else {"CPU": 1.0}


def worker_slots(nodes: list[dict[str, float]], need: dict[str, float]) -> int:
    """How many workers of `need` fit on these nodes' resources (a worker lives on one node)."""
    return sum(min(math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in need.items()) for node in nodes)


def check_fits(workers: int, need: dict[str, float], nodes: list[dict[str, float]]) -> None:
    """Refuse at once what the cluster could never give; a busy cluster is left to the start timeout."""
    slots = worker_slots(nodes, need)
    if slots >= workers:
        return
    have = _totals(nodes)
    totals = {k: have.get(k, 0.0) for k in need}
    raise TunekitError(
        f"training.ray: {workers} workers x {_describe(need)} do not fit the Ray cluster ({len(nodes)} node"
        f"{'s' if len(nodes) != 1 else ''}, {_describe(totals)} in all: room for {slots}); lower "
        "training.ray.workers or resources_per_worker, or add nodes")


def _nodes(ray) -> list[dict[str, float]]:
    """Each live node's resources; an autoscaling cluster's largest size where Ray knows it (as Ray Train's own
    check does: WorkerGroup._check_cluster_resources_and_raise_if_insufficient)."""
    try:
        from ray._private.state import state

        largest = state.get_max_resources_from_cluster_config()
    except Exception:  # a private API: without it, the live nodes
        largest = None
    if largest:
        return [largest]
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def _reachable(address: str) -> None:
    """A head node's HOST:PORT must answer: ray.init retries an unanswered address for many minutes."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise TunekitError(f"training.ray.address {address}: expected HOST:PORT of the head node (its GCS port, 6379 "
                           "by default), auto, or null")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as e:
        raise TunekitError(f"training.ray.address {address}: nothing answers there ({e.strerror or e}); start the "
                           "cluster (ray start --head on the head node) or correct the address") from None


def _connect(ray, ray_cfg: RayConfig) -> bool:
    """Connect (or start a local cluster); True when this call started the connection."""
    if ray.is_initialized():
        return False
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS")
    if address and address not in ("auto", "local") and "://" not in address:
        _reachable(address)
    if ray_cfg.address and "RAY_AUTH_MODE" not in os.environ and (
            os.environ.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").is_file()):
        os.environ["RAY_AUTH_MODE"] = "token"  # what ray.init does for address="auto", for an explicit address too
    try:
        ray.init(address=ray_cfg.address, log_to_driver=True, logging_level=logging.WARNING)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as e:
        where = ray_cfg.address or os.environ.get("RAY_ADDRESS") or "a local cluster"
        raise TunekitError(f"training.ray.address: could not connect to {where} ({first_line(e)}); start the "
                           "cluster (ray start --head on its head node), check the address, or set address: null to "
                           "start a local one") from None
    return True


def _worker_error(failures: dict) -> str:
    """The line that says why: the first worker's own error that is not another rank losing contact."""
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    lines = []
    for rank, error in sorted(failures.items()):
        base = error._base_exc if isinstance(error, UserExceptionWithTraceback) else error
        text = str(base).strip().splitlines()
        line = text[-1] if text and not isinstance(base, TunekitError) else (text[0] if text else "")
        lines.append((base, f"rank {rank}: {line or type(base).__name__}"))
    own = [line for base, line in lines if "lost contact with another process" not in str(base)]
    return (own or [line for _, line in lines])[0]


def launch(ray_cfg: RayConfig, run_dir: Path, worker: Callable[[dict], None], config: dict,
           before_fit: Callable[[], None] = lambda: None):
    """Run `worker(config)` on training.ray.workers Ray Train workers; refused in one line where the cluster cannot
    give them or training fails (after training.ray.max_failures restarts). `before_fit` runs once the cluster has
    room for them. Returns Ray's Result."""
    import signal

    ray = import_ray()
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # read by the driver and passed on to the controller: workers keep the driver's folder; a worker group that
    # cannot start is a controller failure, and controller_failure_limit=0 below makes it final (not retried)
    settings = {"RAY_CHDIR_TO_TRIAL_DIR": "0", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": f"{ray_cfg.start_timeout:g}"}
    before = {k: os.environ.get(k) for k in (*settings, "RAY_AUTH_MODE")}
    interrupt = signal.getsignal(signal.SIGINT)  # Ray's fit() installs its own
    os.environ.update(settings)
    try:
        started = _connect(ray, ray_cfg)
        try:
            nodes = _nodes(ray)
            need = per_worker(ray_cfg, _totals(nodes))
            check_fits(ray_cfg.workers, need, nodes)
            log.info("ray: %d workers x %s on the cluster at %s; run directory %s", ray_cfg.workers, _describe(need),
                     ray.get_runtime_context().gcs_address, run_dir)
            before_fit()
            trainer = TorchTrainer(
                worker, train_loop_config=config,
                scaling_config=ScalingConfig(num_workers=ray_cfg.workers, use_gpu=need.get("GPU", 0) > 0,
                                             resources_per_worker=need),
                run_config=RunConfig(name=run_dir.name, storage_path=str(run_dir.parent),
                                     failure_config=FailureConfig(max_failures=ray_cfg.max_failures,
                                                                  controller_failure_limit=0)))
            return _fit(ray, trainer, ray_cfg, need)
        finally:
            if started:
                ray.shutdown()
    finally:
        signal.signal(signal.SIGINT, interrupt)
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _totals(nodes: list[dict[str, float]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for node in nodes:
        for k, v in node.items():
            totals[k] = totals.get(k, 0.0) + v
    return totals


def _fit(ray, trainer, ray_cfg: RayConfig, need: dict[str, float]):
    from ray.train import ControllerError, WorkerGroupError

    try:
        return trainer.fit()
    except (KeyboardInterrupt, SystemExit):  # Ray's SIGINT handler stops the job and exits 0
        raise TunekitError("training.ray: stopped (interrupted) and the workers with it; train again with --resume to "
                           "continue from the last complete checkpoint") from None
    except WorkerGroupError as e:
        restarts = f" after {ray_cfg.max_failures} restart{'s' if ray_cfg.max_failures != 1 else ''}" \
            if ray_cfg.max_failures else ""
        raise TunekitError(f"training.ray: the run failed{restarts}; {_worker_error(e.worker_failures)} (each "
                           "worker's log is above); after fixing it, train again with --resume to continue from "
                           "the last complete checkpoint") from None
    except ControllerError as e:
        from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

        if isinstance(e.controller_failure, WorkerGroupStartupTimeoutError):
            free = ray.available_resources()
            raise TunekitError(
                f"training.ray: the cluster did not give {ray_cfg.workers} workers x {_describe(need)} within "
                f"{ray_cfg.start_timeout:g} s, at the start or after a restart (free now: "
                f"{_describe({k: free.get(k, 0.0) for k in need})}); wait for the jobs holding them, lower "
                "training.ray.workers, or raise training.ray.start_timeout; --resume continues a run that had "
                "started") from None
        raise TunekitError(f"training.ray: Ray Train's controller failed ({first_line(e.controller_failure)})") \
            from None
