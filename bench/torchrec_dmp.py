"""TorchRec's distributed training, the peer users would pick, on the same batches and model as Bagpipe.

One rank of a standard TorchRec job: ``DistributedModelParallel`` over TorchRec's ``DLRM`` (``DLRMTrain``)
with an ``EmbeddingBagCollection`` whose tables the ``EmbeddingShardingPlanner`` places (on CPU it offers
data_parallel, table_wise, column_wise and table_column_wise, and refuses row_wise: "No available sharding
type and compute kernel combination"), the embedding optimizer fused into FBGEMM's backward
(``apply_optimizer_in_backward``: row-wise Adagrad, TorchRec's usual, or SGD), the dense one through
``KeyedOptimizerWrapper``, and ``TrainPipelineSparseDist``, which overlaps the next batch's input
all-to-all with this one's compute. gloo carries the collectives (on CPU TorchRec runs nothing else).

Rank r trains on its slice ``[r*B/W, (r+1)*B/W)`` of global batch b of Bagpipe's synthetic source (the same
seed and table sizes), so both systems see the same samples. ``--init`` loads a TorchRec state dict (``bagpipe
export --to torchrec`` of a Bagpipe ``--save-initial``) into the sharded model, so that both start from
the same weights; then, with SGD, the loss curves agree to float noise (the harness's check): TorchRec
averages the ranks' gradients of their local means, for the tables as DDP does for the dense part, which is
the gradient of the global batch's mean that Bagpipe takes.

Run in TorchRec's environment (``make bench-torchrec-env``), one process a rank::

    bench/.venv-torchrec/bin/python bench/torchrec_dmp.py --rank 0 --world-size 2 --master 127.0.0.1:29611 ...

Rank 0 prints one JSON line: the planner's plan (sharding type per table), the median and p90 iteration
time over the timed iterations, samples/s, and the loss of every batch (the global mean).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "services"))

from bagpipe.core.data import SyntheticConfig, SyntheticSource, scaled_table_rows  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--master", default="127.0.0.1:29611", help="rank 0's host:port (the rendezvous)")
    p.add_argument("--batch-size", type=int, default=2048, help="global batch size")
    p.add_argument("--scale", type=float, default=0.01)
    p.add_argument("--table-rows", default=None, help="comma-separated (default: Kaggle x --scale)")
    p.add_argument("--seed", type=int, default=0, help="of the synthetic data, as bagpipe run --seed")
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--bottom-mlp", default="128,64")
    p.add_argument("--top-mlp", default="128,1")
    p.add_argument("--optimizer", choices=["adagrad", "sgd"], default="adagrad")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20, help="iterations left out of the timing")
    p.add_argument("--init", default=None, help="a TorchRec DLRM state dict to start from")
    p.add_argument(
        "--sharding",
        choices=["planner", "table_wise", "row_wise", "column_wise"],
        default="planner",
        help="planner: the planner's choice per table (the standard setup); or every table sharded this way "
        "(row_wise: refused on CPU by TorchRec 1.8's planner)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may wait")
    return p.parse_args()


def load_full_state(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> int:
    """Copies an unsharded DLRM state dict into the sharded model, in place: each ShardedTensor's local
    shards take their rows and columns of the full table; dense tensors are copied whole. Returns the
    number of tensors loaded."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    loaded = 0
    for name, target in model.state_dict().items():
        key = name.removeprefix("module.").removeprefix("model.")
        if key not in full:
            continue
        source = full[key]
        with torch.no_grad():
            if isinstance(target, ShardedTensor):
                for shard in target.local_shards():
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(source[r0 : r0 + nr, c0 : c0 + nc])
            else:
                target.copy_(source)
        loaded += 1
    return loaded


def main() -> None:
    a = parse()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", a.master.rsplit(":", 1)[0])
    os.environ.setdefault("MASTER_PORT", a.master.rsplit(":", 1)[1])
    from datetime import timedelta

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}",
        rank=a.rank,
        world_size=a.world_size,
        timeout=timedelta(seconds=a.timeout),
    )
    from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: F401  (loads FBGEMM's ops)
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.datasets.utils import Batch
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    rows = [int(r) for r in a.table_rows.split(",")] if a.table_rows else scaled_table_rows(a.scale)
    bottom = [int(x) for x in a.bottom_mlp.split(",")]
    top = [int(x) for x in a.top_mlp.split(",")]
    tables = [
        EmbeddingBagConfig(
            name=f"t{t}", embedding_dim=a.embedding_dim, num_embeddings=n, feature_names=[f"f{t}"]
        )
        for t, n in enumerate(rows)
    ]
    cpu = torch.device("cpu")
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=13,
            dense_arch_layer_sizes=bottom,
            over_arch_layer_sizes=top,
            dense_device=cpu,
        )
    )
    if a.optimizer == "adagrad":
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": a.lr})
    else:
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": a.lr})
    sharders = [EmbeddingBagCollectionSharder()]
    constraints = (
        {f"t{t}": ParameterConstraints(sharding_types=[a.sharding]) for t in range(len(rows))}
        if a.sharding != "planner"
        else None
    )
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=a.world_size, compute_device="cpu"),
        batch_size=a.batch_size // a.world_size,
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(module=model, device=cpu, plan=plan, sharders=sharders)
    if a.init:
        full = torch.load(a.init, map_location="cpu", weights_only=True)
        loaded = load_full_state(dmp, full)
        assert loaded == len(full), f"{a.init}: loaded {loaded} of {len(full)} tensors"
    dense_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        (lambda params: torch.optim.Adagrad(params, lr=a.lr))
        if a.optimizer == "adagrad"
        else (lambda params: torch.optim.SGD(params, lr=a.lr)),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense_optimizer])
    pipeline = TrainPipelineSparseDist(dmp, optimizer, cpu)

    source = SyntheticSource(SyntheticConfig(table_rows=tuple(rows), seed=a.seed))
    share = a.batch_size // a.world_size
    keys = [f"f{t}" for t in range(len(rows))]

    def batches():
        for number in range(a.iterations):
            s = source.batch(number, a.batch_size)
            lo, hi = a.rank * share, (a.rank + 1) * share
            sparse = torch.from_numpy(s.sparse[lo:hi]).t().contiguous()  # [tables, b]: feature-major
            yield Batch(
                dense_features=torch.from_numpy(s.dense[lo:hi]),
                sparse_features=KeyedJaggedTensor.from_lengths_sync(
                    keys=keys, values=sparse.view(-1), lengths=torch.ones(sparse.numel(), dtype=torch.int32)
                ),
                labels=torch.from_numpy(s.labels[lo:hi]),
            )

    it = iter(batches())
    losses, seconds = [], []
    dmp.train()
    for _ in range(a.iterations):
        t0 = time.perf_counter()
        loss = pipeline.progress(it)[0]  # (DLRMTrain's (loss, logits, labels), detached)
        seconds.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # (outside the timing: the global batch's mean, Bagpipe's loss)
        losses.append(float(mean) / a.world_size)
    timed = sorted(seconds[a.warmup :]) or sorted(seconds)
    if a.rank == 0:
        kinds: dict[str, int] = {}
        placement = {}
        for module_plan in plan.plan.values():
            for table, parameter in module_plan.items():  # type: ignore[union-attr]
                kinds[parameter.sharding_type] = kinds.get(parameter.sharding_type, 0) + 1
                placement[table] = {
                    "sharding_type": parameter.sharding_type,
                    "compute_kernel": parameter.compute_kernel,
                    "ranks": parameter.ranks,
                }
        print(
            json.dumps(
                {
                    "system": "torchrec-dmp",
                    "world_size": a.world_size,
                    "optimizer": a.optimizer,
                    "sharding_types": kinds,
                    "plan": placement,
                    "plan_text": str(plan),
                    "iterations": a.iterations,
                    "timed_iterations": len(timed),
                    "iteration_ms": [1000 * t for t in seconds[a.warmup :]],
                    "median_ms": 1000 * statistics.median(timed),
                    "mean_ms": 1000 * statistics.fmean(timed),
                    "p90_ms": 1000 * timed[int(0.9 * (len(timed) - 1))],
                    "samples_per_second": a.batch_size / statistics.median(timed),
                    "losses": losses,
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
