"""Run with TorchRec's interpreter (bench/.venv-torchrec/bin/python), not Bagpipe's: builds
``torchrec.models.dlrm.DLRM`` from an exported state dict's sidecar (``OUT.json``), loads the state dict
with ``strict=True`` and writes its logits on a batch.

    torchrec_logits.py STATE BATCH LOGITS [STATE BATCH LOGITS ...]

BATCH is a ``torch.save``'d ``{"dense": [B, dense_in_features], "ids": [B, tables]}`` (one id per sample
per feature); LOGITS gets the model's output, [B].
"""

from __future__ import annotations

import json
import sys

import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def logits(state_path: str, batch_path: str) -> torch.Tensor:
    with open(state_path + ".json", encoding="utf-8") as f:
        spec = json.load(f)
    tables = [
        EmbeddingBagConfig(
            name=t["name"],
            embedding_dim=t["embedding_dim"],
            num_embeddings=t["num_embeddings"],
            feature_names=t["feature_names"],
            pooling=PoolingType[t["pooling"]],
        )
        for t in spec["tables"]
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
        dense_in_features=spec["dense_in_features"],
        dense_arch_layer_sizes=spec["dense_arch_layer_sizes"],
        over_arch_layer_sizes=spec["over_arch_layer_sizes"],
    )
    model.load_state_dict(torch.load(state_path, weights_only=True), strict=True)
    batch = torch.load(batch_path, weights_only=True)
    ids = batch["ids"]
    size, features = ids.shape
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=[name for t in spec["tables"] for name in t["feature_names"]],
        values=ids.t().reshape(-1),  # (feature-major: every sample's id of f0, then of f1, ...)
        lengths=torch.ones(features * size, dtype=torch.int32),
    )
    model.eval()
    with torch.no_grad():
        return model(batch["dense"], sparse).squeeze(1)


def main() -> None:
    args = sys.argv[1:]
    for i in range(0, len(args), 3):
        torch.save(logits(args[i], args[i + 1]), args[i + 2])


if __name__ == "__main__":
    main()
