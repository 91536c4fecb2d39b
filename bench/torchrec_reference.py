"""TorchRec on the same data and model, as an outside reference for the compute cost.

Runs in its own virtual environment (``bench/.venv-torchrec``: torch 2.13, fbgemm-gpu-cpu 1.8.0,
torchrec 1.8.0; see ../shared/TOOLING.md), single process, on one trainer's slice of each global batch
(B/T samples) of the same synthetic batches Bagpipe trains on. The model is TorchRec's DLRM with the
same table sizes, embedding dimension and MLPs; its embedding tables are FBGEMM's table-batched
embedding (the kernel TorchRec trains with) with a fused exact row-wise Adagrad, so no embedding ever
crosses a network: this is TorchRec's per-trainer compute, the floor under any distributed setup.
With ``--device cuda`` the tables and the MLPs live on the GPU (FBGEMM's CUDA kernels, which need the
``fbgemm-gpu`` wheel built for the installed torch and CUDA) and each batch is copied there before its
timing starts.

    bench/.venv-torchrec/bin/python bench/torchrec_reference.py --batch-size 2048 --trainers 2 ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "services"))

from bagpipe.core.data import SyntheticConfig, SyntheticSource, scaled_table_rows  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=2048, help="global batch size")
    p.add_argument("--trainers", type=int, default=2, help="each trainer trains B/T samples")
    p.add_argument("--scale", type=float, default=0.01)
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--bottom-mlp", default="128,64")
    p.add_argument("--top-mlp", default="128,1")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    device = torch.device(a.device)

    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )
    from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch

    rows = scaled_table_rows(a.scale)
    dim, tables = a.embedding_dim, len(rows)
    bottom = [int(x) for x in a.bottom_mlp.split(",")]
    top = [int(x) for x in a.top_mlp.split(",")]
    where = (
        (EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
        if device.type == "cuda"
        else (EmbeddingLocation.HOST, ComputeDevice.CPU)
    )
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(n, dim, *where) for n in rows],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=a.lr,
        eps=1e-10,
        pooling_mode=PoolingMode.SUM,
        device=device,
    )
    dense_arch = DenseArch(13, bottom, device=device)
    interaction = InteractionArch(num_sparse_features=tables).to(device)  # its triu_indices buffer
    over = OverArch(dim + tables * (tables + 1) // 2, top, device=device)
    dense_params = list(dense_arch.parameters()) + list(over.parameters())
    opt = torch.optim.Adagrad(dense_params, lr=a.lr, eps=1e-10)
    source = SyntheticSource(SyntheticConfig(table_rows=tuple(rows)))
    per = a.batch_size // a.trainers
    times = []
    for b in range(a.iterations):
        s = source.batch(b, a.batch_size)
        dense = torch.from_numpy(s.dense[:per].copy()).to(device)
        labels = torch.from_numpy(s.labels[:per].copy()).to(device)
        ids = torch.from_numpy(s.sparse[:per].T.reshape(-1).astype("int64")).to(device)  # table-major
        offsets = torch.arange(0, tables * per + 1, dtype=torch.int64, device=device)  # one id per bag
        sync(device)
        t0 = time.perf_counter()
        pooled = tbe(ids, offsets).view(per, tables, dim)
        x = dense_arch(dense)
        logits = over(interaction(x, pooled)).squeeze(1)
        loss = (
            torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
            / a.batch_size
        )
        opt.zero_grad()
        loss.backward()  # TBE applies its fused row-wise Adagrad in the backward pass
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    warm = times[max(5, len(times) // 10) :]
    result = {
        "system": "torchrec (fbgemm TBE, single trainer slice, no communication)",
        "batch_size": a.batch_size,
        "trainers": a.trainers,
        "samples_per_iteration": per,
        "median_ms": 1000 * statistics.median(warm),
        "p90_ms": 1000 * sorted(warm)[int(0.9 * (len(warm) - 1))],
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


def sync(device: torch.device) -> None:
    """Wait for the GPU's queued work, so a timing holds the kernels and not only their launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
