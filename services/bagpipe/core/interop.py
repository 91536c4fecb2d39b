"""TorchRec interop: Bagpipe's DLRM as the state dict of TorchRec's ``torchrec.models.dlrm.DLRM``, and back.

TorchRec's DLRM (checked against torchrec 1.8) computes what Bagpipe's does, layer for layer:

* ``DenseArch`` is the bottom MLP, ReLU after every layer;
* ``InteractionArch`` takes the dot products of every pair of [dense arch output, the F pooled embeddings]
  (the dense vector is one of the features, as in Bagpipe) and puts them after the dense arch output;
* ``OverArch`` is the top MLP: ReLU after every layer but the last (its own ``nn.Linear``).

With one id per sample per feature and SUM pooling, a pooled embedding is the table's row. Only the order
of the pairs differs: TorchRec takes ``triu_indices(F + 1, F + 1, 1)``, (0,1), (0,2), …, (0,F), (1,2), …,
Bagpipe ``tril_indices(F + 1, F + 1, -1)``, (1,0), (2,0), (2,1), (3,0), …; a dot product does not care
which of its two features comes first, so the mapping permutes the first over-arch layer's input columns
(``pair_permutation``), which gives the same logits up to float summation order.

The names: table t is ``t<t>`` (feature ``f<t>``), its rows
``sparse_arch.embedding_bag_collection.embedding_bags.t<t>.weight``; bottom layer k
``dense_arch.model._mlp.<k>._linear.weight|bias``; top layer k ``over_arch.model.0._mlp.<k>._linear.*``,
the last one ``over_arch.model.1.*``. TorchRec's state dict holds no optimizer state.

Bagpipe's other models have no TorchRec counterpart (``REFUSALS`` says why for each).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from bagpipe.core.model_config import ModelConfig

TABLES = "sparse_arch.embedding_bag_collection.embedding_bags."
DENSE_ARCH = "dense_arch.model._mlp."
OVER_ARCH_MLP = "over_arch.model.0._mlp."
OVER_ARCH_LAST = "over_arch.model.1."
TESTED_WITH = "torchrec 1.8.0"

# why `bagpipe export --to torchrec` refuses each model that is not DLRM
REFUSALS = {
    "wdl": "TorchRec has no Wide&Deep model (torchrec.models has DLRM, its DCN and projection variants, and "
    "SimpleDeepFMNN)",
    "deepfm": "TorchRec's SimpleDeepFMNN is another model: it feeds the dense features through an MLP into "
    "the factorisation machine, has no first-order weight per category, and ends in a sigmoid, where "
    "Bagpipe's DeepFM (Guo et al.) has a linear first-order part with a weight per category",
    "dcn": "TorchRec's DLRM_DCN is DLRM with a DCN-v2 (low-rank) cross network as its interaction, not "
    "Deep & Cross (Wang et al. 2017, DCN-v1) as Bagpipe trains it: cross layers with vector weights beside "
    "a deep tower on [dense, embeddings]",
}

_DENSE_NAME = re.compile(r"(bottom_mlp|top_mlp)\.(\d+)\.(weight|bias)")
_TORCHREC_NAME = re.compile(
    r"(?:dense_arch\.model\._mlp\.(?P<bottom>\d+)\._linear|over_arch\.model\.0\._mlp\.(?P<top>\d+)\._linear"
    r"|over_arch\.model\.(?P<last>1))\.(?P<kind>weight|bias)"
)


def pair_permutation(num_tables: int) -> torch.Tensor:
    """For each of TorchRec's interaction outputs (pairs of [dense, F tables] in ``triu_indices`` order),
    the position of the same pair among Bagpipe's (``tril_indices`` order): TorchRec's pair m is
    Bagpipe's pair ``pair_permutation(F)[m]``."""
    features = num_tables + 1
    rows, cols = torch.tril_indices(features, features, offset=-1)
    position = torch.empty(features, features, dtype=torch.long)
    position[rows, cols] = torch.arange(rows.numel())
    i, j = torch.triu_indices(features, features, offset=1)
    return position[j, i]  # (TorchRec's pair (i, j), i < j, is Bagpipe's (j, i))


def _layers(dense: Mapping[str, Any], mlp: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``mlp``'s (weight, bias) pairs, layer 0 first."""
    count = len({k for k in dense if k.startswith(mlp + ".")}) // 2
    out = []
    for k in range(count):
        weight, bias = dense.get(f"{mlp}.{k}.weight"), dense.get(f"{mlp}.{k}.bias")
        if not isinstance(weight, torch.Tensor) or not isinstance(bias, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"dense/{mlp}.{k}: expected a Linear's weight and bias")
        out.append((weight, bias))
    return out


def model_of(ckpt: Mapping[str, Any]) -> str:
    """The model an interchange checkpoint holds: its ``meta.model``, else what its dense names say."""
    meta = ckpt.get("meta") or {}
    if meta.get("model"):
        return str(meta["model"])
    return "dlrm" if any(k.startswith("bottom_mlp.") for k in ckpt.get("dense", {})) else "unknown"


def to_torchrec(ckpt: Mapping[str, Any]) -> tuple[OrderedDict[str, torch.Tensor], dict[str, Any]]:
    """An interchange checkpoint of DLRM as TorchRec DLRM's state dict (``load_state_dict(strict=True)``
    takes it) and the sizes to build that model with (``dense_in_features``, ``dense_arch_layer_sizes``,
    ``over_arch_layer_sizes``, ``tables``). ValueError says why a checkpoint cannot be exported."""
    model = model_of(ckpt)
    if model != "dlrm":
        why = REFUSALS.get(model, f"{model!r} is not one of Bagpipe's models that TorchRec has")
        raise ValueError(f"cannot export --model {model} to TorchRec: {why}; only dlrm exports")
    dense = ckpt["dense"]
    unknown = sorted(k for k in dense if not _DENSE_NAME.fullmatch(k))
    if unknown:
        raise ValueError(f"dense: not DLRM's parameters: {', '.join(unknown[:5])}")
    bottom, top = _layers(dense, "bottom_mlp"), _layers(dense, "top_mlp")
    tables = [ckpt["embeddings"].get(str(t)) for t in range(len(ckpt["embeddings"]))]
    if not bottom or not top or not tables or any(not isinstance(t, torch.Tensor) for t in tables):
        raise ValueError("not a DLRM checkpoint: it needs bottom_mlp, top_mlp and tables '0', '1', …")
    dim = bottom[-1][0].shape[0]
    if any(t.dim() != 2 or t.shape[1] != dim for t in tables):
        raise ValueError(f"embeddings: every table must be [rows, {dim}] (the bottom MLP's output)")
    if len(top) < 2:
        raise ValueError(
            "cannot export to TorchRec: its DLRM's OverArch needs at least two layers (an MLP, then the "
            f"last Linear), this top MLP has {len(top)} (--top-mlp {top[0][0].shape[0]})"
        )
    pairs = len(tables) * (len(tables) + 1) // 2
    if top[0][0].shape[1] != dim + pairs:
        raise ValueError(f"dense/top_mlp.0.weight: expected {dim + pairs} inputs, has {top[0][0].shape[1]}")

    state: OrderedDict[str, torch.Tensor] = OrderedDict()  # (in the order TorchRec's state_dict has)
    for t, rows in enumerate(tables):
        state[f"{TABLES}t{t}.weight"] = rows.float().contiguous().clone()
    for k, (weight, bias) in enumerate(bottom):
        state[f"{DENSE_ARCH}{k}._linear.weight"] = weight.clone()
        state[f"{DENSE_ARCH}{k}._linear.bias"] = bias.clone()
    for k, (weight, bias) in enumerate(top):
        if k == 0:  # TorchRec's pair m is Bagpipe's pair perm[m]: take that column
            perm = pair_permutation(len(tables)) + dim
            weight = torch.cat([weight[:, :dim], weight[:, perm]], dim=1)
        prefix = OVER_ARCH_LAST if k == len(top) - 1 else f"{OVER_ARCH_MLP}{k}._linear."
        state[prefix + "weight"] = weight.contiguous().clone()
        state[prefix + "bias"] = bias.clone()
    spec = {
        "model": "torchrec.models.dlrm.DLRM",
        "tested_with": TESTED_WITH,
        "dense_in_features": int(bottom[0][0].shape[1]),
        "dense_arch_layer_sizes": [int(w.shape[0]) for w, _ in bottom],
        "over_arch_layer_sizes": [int(w.shape[0]) for w, _ in top],
        "tables": [
            {
                "name": f"t{t}",
                "num_embeddings": int(rows.shape[0]),
                "embedding_dim": int(dim),
                "feature_names": [f"f{t}"],
                "pooling": "SUM",
            }
            for t, rows in enumerate(tables)
        ],
        "input": "dense_features [B, dense_in_features] (log(1+x), as Bagpipe's); sparse_features a "
        "KeyedJaggedTensor with keys f0, f1, … and one id per sample per feature (the table's row)",
        "optimizer_state": "not exported (TorchRec's model state dict has none)",
        "optimizer_steps": (ckpt.get("meta") or {}).get("optimizer_steps"),
    }
    return state, spec


def is_torchrec_dlrm(state: Mapping[str, Any]) -> bool:
    """Whether a loaded ``torch.save`` dictionary is a TorchRec DLRM state dict (its keys say so)."""
    return any(isinstance(k, str) and TABLES in k for k in state) and "dense" not in state


def from_torchrec(state: Mapping[str, Any]) -> dict[str, Any]:
    """A TorchRec DLRM state dict (``DLRM.state_dict()``, also with a prefix such as ``DLRMTrain``'s
    ``model.``) as an interchange checkpoint without optimizer state, the inverse of ``to_torchrec``.
    Tables are taken in the state dict's order (that of the ``EmbeddingBagConfig``s, TorchRec's feature
    order), or by number where they are all named ``t<number>``. ValueError names what does not fit."""
    anchor = next(k for k in state if TABLES in k)
    prefix = anchor[: anchor.index(TABLES)]
    foreign = [k for k in state if not k.startswith(prefix)]
    if foreign:
        raise ValueError(f"TorchRec state dict: keys outside {prefix!r}: {', '.join(foreign[:5])}")
    tables: dict[str, torch.Tensor] = {}
    bottom: dict[int, dict[str, torch.Tensor]] = {}
    top: dict[int, dict[str, torch.Tensor]] = {}
    last: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in state.items():
        name = key[len(prefix) :]
        match = _TORCHREC_NAME.fullmatch(name)
        if name.startswith(TABLES) and name.endswith(".weight"):
            tables[name[len(TABLES) : -len(".weight")]] = value
        elif match and match["bottom"] is not None:
            bottom.setdefault(int(match["bottom"]), {})[match["kind"]] = value
        elif match and match["top"] is not None:
            top.setdefault(int(match["top"]), {})[match["kind"]] = value
        elif match:
            last[match["kind"]] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(
            "not TorchRec's plain DLRM (DLRM_DCN and DLRM_Projection have other interactions): unexpected "
            f"keys {', '.join(unknown[:5])}"
        )
    bottom_layers = [bottom.get(k, {}) for k in range(len(bottom))]
    over = [top.get(k, {}) for k in range(len(top))] + [last]
    if not bottom or any(set(layer) != {"weight", "bias"} for layer in [*bottom_layers, *over]):
        raise ValueError("TorchRec state dict: dense_arch or over_arch layers are missing or incomplete")
    numbered = [re.fullmatch(r"t(\d+)", name) for name in tables]
    names = list(tables)
    if all(numbered) and sorted(int(m[1]) for m in numbered if m) == list(range(len(tables))):
        names.sort(key=lambda name: int(name[1:]))
    weights = [tables[name] for name in names]
    dim = int(bottom_layers[-1]["weight"].shape[0])
    for name, rows in zip(names, weights, strict=True):
        if rows.dim() != 2 or rows.shape[1] != dim:
            raise ValueError(
                f"TorchRec table {name!r}: expected [rows, {dim}] (the dense arch's output), "
                f"got {list(rows.shape)}"
            )
    dense: dict[str, torch.Tensor] = {}
    for k, layer in enumerate(bottom_layers):
        dense[f"bottom_mlp.{k}.weight"] = layer["weight"].clone()
        dense[f"bottom_mlp.{k}.bias"] = layer["bias"].clone()
    pairs = len(weights) * (len(weights) + 1) // 2
    if over[0]["weight"].shape[1] != dim + pairs:
        raise ValueError(
            f"TorchRec over_arch: expected {dim + pairs} inputs for {len(weights)} tables of dim {dim}, "
            f"has {over[0]['weight'].shape[1]}"
        )
    for k, layer in enumerate(over):
        weight = layer["weight"]
        if k == 0:  # back to Bagpipe's pair order: its pair perm[m] is TorchRec's pair m
            weight = weight.clone()
            weight[:, pair_permutation(len(weights)) + dim] = layer["weight"][:, dim:]
        dense[f"top_mlp.{k}.weight"] = weight.contiguous().clone()
        dense[f"top_mlp.{k}.bias"] = layer["bias"].clone()
    return {
        "dense": dense,
        "embeddings": {str(t): rows.float().contiguous() for t, rows in enumerate(weights)},
        "meta": {
            "model": "dlrm",
            "bottom_mlp": [int(layer["weight"].shape[0]) for layer in bottom_layers],
            "top_mlp": [int(layer["weight"].shape[0]) for layer in over],
            "table_rows": [int(rows.shape[0]) for rows in weights],
            "embedding_dim": dim,
            "num_dense": int(bottom_layers[0]["weight"].shape[1]),
            "source": "torchrec",
            "torchrec_tables": names,
        },
    }


def check_fits(
    meta: Mapping[str, Any],
    model: str,
    embedding_dim: int,
    table_rows: Sequence[int],
    dense: ModelConfig | None = None,
) -> None:
    """Raises ValueError naming every size of a TorchRec DLRM (``from_torchrec``'s ``meta``) that differs
    from the run's flags: the model, the tables' count and sizes, the dimension and, given ``dense``, the
    dense input and the MLPs."""
    if model != "dlrm":
        raise ValueError(f"a TorchRec DLRM state dict: only --model dlrm can start from it, not {model}")
    names = meta["torchrec_tables"]
    have, want = list(meta["table_rows"]), list(table_rows)
    differ = []
    if len(have) != len(want):
        differ.append(f"{len(have)} tables, the run has {len(want)} (--table-rows, or the data's tables)")
    else:
        wrong = [f"{names[t]} (table {t}) has {have[t]}" for t in range(len(have)) if have[t] != want[t]]
        if wrong:
            differ.append(
                f"table rows differ from --table-rows {','.join(map(str, want))}: {', '.join(wrong[:8])}"
                + (f" and {len(wrong) - 8} more" if len(wrong) > 8 else "")
            )
    if meta["embedding_dim"] != embedding_dim:
        differ.append(f"embedding dim {meta['embedding_dim']}, --embedding-dim {embedding_dim}")
    if dense is not None:
        if meta["num_dense"] != dense.num_dense:
            differ.append(f"dense_in_features {meta['num_dense']}, the data has {dense.num_dense}")
        for flag, key, ours in (
            ("--bottom-mlp", "bottom_mlp", "dense_arch"),
            ("--top-mlp", "top_mlp", "over_arch"),
        ):
            if tuple(meta[key]) != tuple(getattr(dense, key)):
                run = ",".join(map(str, getattr(dense, key)))
                differ.append(f"{ours} layer sizes {','.join(map(str, meta[key]))}, {flag} {run}")
    if differ:
        raise ValueError("a TorchRec DLRM state dict that does not fit this run: " + "; ".join(differ))
