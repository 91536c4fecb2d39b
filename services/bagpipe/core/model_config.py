"""The recommendation models' sizes and names (``ModelConfig``), apart from the modules in ``model.py``:
services that only need a row's width (the embedding servers, the configuration parsers) read them
without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

MODELS = ("dlrm", "wdl", "deepfm", "dcn")
# models whose rows carry a first-order weight after the embedding vector
LINEAR_MODELS = frozenset({"wdl", "deepfm"})


def row_width(model: str, embedding_dim: int) -> int:
    """Floats per embedding row as servers and caches store it: the vector, then the first-order weight
    for the models that have one (``LINEAR_MODELS``)."""
    return embedding_dim + int(model in LINEAR_MODELS)


# the deep tower's hidden sizes when --deep-mlp is not given (Bagpipe paper Table 2, narrowed to what
# the default embedding sizes feed)
DEFAULT_DEEP_MLP = {"wdl": (256, 256, 256), "deepfm": (64, 64, 64), "dcn": (256, 128, 64)}
DEFAULT_CROSS_LAYERS = 3


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the dense part; ``*_mlp`` are the output sizes of each layer."""

    num_dense: int = 13
    num_tables: int = 26
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64, 16)
    top_mlp: tuple[int, ...] = (64, 1)
    name: str = "dlrm"
    deep_mlp: tuple[int, ...] = ()  # () : DEFAULT_DEEP_MLP[name]
    cross_layers: int = DEFAULT_CROSS_LAYERS

    def __post_init__(self) -> None:
        if self.name not in MODELS:
            raise ValueError(f"model: must be one of {', '.join(MODELS)}, got {self.name!r}")
        if self.embedding_dim < 1:
            raise ValueError(f"embedding_dim: must be >= 1, got {self.embedding_dim}")
        if self.num_tables < 1 or self.num_dense < 0:
            raise ValueError(f"num_tables/num_dense: need >= 1 table, got {self.num_tables}/{self.num_dense}")
        if self.name == "dlrm":
            if not self.bottom_mlp or min(self.bottom_mlp) < 1:
                raise ValueError(f"bottom_mlp: needs positive layer sizes, got {self.bottom_mlp}")
            if not self.top_mlp or min(self.top_mlp) < 1:
                raise ValueError(f"top_mlp: needs positive layer sizes, got {self.top_mlp}")
            if self.bottom_mlp[-1] != self.embedding_dim:
                raise ValueError(
                    f"bottom_mlp: the last size ({self.bottom_mlp[-1]}) must equal embedding_dim "
                    f"({self.embedding_dim}) for the dot interaction"
                )
            if self.top_mlp[-1] != 1:
                raise ValueError(f"top_mlp: the last size must be 1 (one logit), got {self.top_mlp[-1]}")
            return
        if not self.deep_mlp:
            object.__setattr__(self, "deep_mlp", DEFAULT_DEEP_MLP[self.name])
        if min(self.deep_mlp) < 1:
            raise ValueError(f"deep_mlp: needs positive layer sizes, got {self.deep_mlp}")
        if self.name == "dcn" and self.cross_layers < 1:
            raise ValueError(f"cross_layers: must be >= 1, got {self.cross_layers}")

    @property
    def linear(self) -> bool:
        """Rows carry a first-order weight (one column after the embedding vector)."""
        return self.name in LINEAR_MODELS

    @property
    def row_width(self) -> int:
        """Floats per embedding row as servers and caches store it."""
        return row_width(self.name, self.embedding_dim)

    @property
    def interaction_size(self) -> int:
        features = self.num_tables + 1
        return features * (features - 1) // 2 + self.embedding_dim

    @property
    def flat_size(self) -> int:
        """Width of [dense, embeddings flattened]: the deep (and cross) input."""
        return self.num_dense + self.num_tables * self.embedding_dim

    def describe(self) -> dict[str, object]:
        """The flags that define this model, for checkpoints' meta and the run record."""
        if self.name == "dlrm":
            return {"model": "dlrm", "bottom_mlp": list(self.bottom_mlp), "top_mlp": list(self.top_mlp)}
        out: dict[str, object] = {"model": self.name, "deep_mlp": list(self.deep_mlp)}
        if self.name == "dcn":
            out["cross_layers"] = self.cross_layers
        return out
