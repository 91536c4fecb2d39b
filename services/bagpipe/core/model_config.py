"""The recommendation models' sizes and names (``ModelConfig``), apart from the modules in ``model.py``:
services that only need a row's width (the embedding servers, the configuration parsers) read them
without loading torch.

``--model`` is one of the built-in models (``MODELS``) or ``MODULE:CLASS``, the user's own
``torch.nn.Module`` subclass (docs/models.md, "Your own model"). Every process that needs the model or its
row width imports that class by name (``model_class``), so its module must be importable there: loading
torch then is the price of a custom model's row width in an embedding server.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass, fields

MODELS = ("dlrm", "wdl", "deepfm", "dcn")
# models whose rows carry a first-order weight after the embedding vector
LINEAR_MODELS = frozenset({"wdl", "deepfm"})
# the keywords a model class is built with: Class(num_dense=..., num_tables=..., embedding_dim=...)
CONSTRUCTOR_KEYWORDS = ("num_dense", "num_tables", "embedding_dim")


def is_builtin(model: str) -> bool:
    """``model`` is one of ``MODELS``, not a ``MODULE:CLASS`` of the user's."""
    return model in MODELS


@functools.cache
def model_class(spec: str) -> type:
    """The ``torch.nn.Module`` subclass ``spec`` (``"package.module:Class"``) names, imported here.
    ValueError (``"model: why"``) says what failed: the spelling, the import, the attribute, the class
    (not an ``nn.Module`` subclass, a constructor that does not take ``CONSTRUCTOR_KEYWORDS``, a
    ``first_order`` that is not a bool)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute or ":" in attribute:
        raise ValueError(
            f"model: must be one of {', '.join(MODELS)} or MODULE:CLASS (your own torch.nn.Module "
            f"subclass), got {spec!r}"
        )
    if module_name == "__main__":
        raise ValueError(
            f"model: {spec}: a class of __main__ (a script, a notebook) cannot be imported by the trainers "
            "and embedding servers; put it in a module they can import"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(
                f"model: {spec}: no module named {e.name!r} (the module must be importable by every "
                "trainer and embedding server: installed, or on PYTHONPATH)"
            ) from None
        raise ValueError(f"model: {spec}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    except Exception as e:  # (the module's own code failed: say how, not where we called it)
        raise ValueError(f"model: {spec}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    try:
        cls = functools.reduce(getattr, attribute.split("."), module)
    except AttributeError:
        raise ValueError(f"model: {spec}: module {module_name} has no attribute {attribute!r}") from None
    from torch import nn  # (only for a model of the user's: its module has loaded torch already)

    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        what = f"the class {cls.__name__}" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise ValueError(f"model: {spec}: not a torch.nn.Module subclass ({what})")
    first_order = getattr(cls, "first_order", False)
    if not isinstance(first_order, bool):
        raise ValueError(f"model: {spec}: first_order must be True or False, got {first_order!r}")
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # (no signature to read: building it will tell)
        return cls
    try:
        signature.bind(**dict.fromkeys(CONSTRUCTOR_KEYWORDS, 1))
    except TypeError as e:
        keywords = ", ".join(f"{k}=..." for k in CONSTRUCTOR_KEYWORDS)
        raise ValueError(f"model: {spec}: cannot be built as {attribute}({keywords}): {e}") from None
    return cls


def first_order(model: str) -> bool:
    """Rows of ``model`` carry a first-order weight after the embedding vector: the built-ins of
    ``LINEAR_MODELS``, and a model class whose ``first_order`` is True (imported to read it)."""
    if is_builtin(model):
        return model in LINEAR_MODELS
    return bool(getattr(model_class(model), "first_order", False))


def row_width(model: str, embedding_dim: int) -> int:
    """Floats per embedding row as servers and caches store it: the vector, then the first-order weight
    for the models that have one (``first_order``)."""
    return embedding_dim + int(first_order(model))


# the deep tower's hidden sizes when --deep-mlp is not given (Bagpipe paper Table 2, narrowed to what
# the default embedding sizes feed)
DEFAULT_DEEP_MLP = {"wdl": (256, 256, 256), "deepfm": (64, 64, 64), "dcn": (256, 128, 64)}
DEFAULT_CROSS_LAYERS = 3


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the dense part; ``*_mlp`` are the output sizes of each layer. ``name`` is a built-in model
    or ``MODULE:CLASS``, a model class of the user's, built from ``num_dense``, ``num_tables`` and
    ``embedding_dim`` alone: the other sizes are the built-ins' and keep their defaults for it."""

    num_dense: int = 13
    num_tables: int = 26
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64, 16)
    top_mlp: tuple[int, ...] = (64, 1)
    name: str = "dlrm"
    deep_mlp: tuple[int, ...] = ()  # () : DEFAULT_DEEP_MLP[name]
    cross_layers: int = DEFAULT_CROSS_LAYERS

    def __post_init__(self) -> None:
        if self.embedding_dim < 1:
            raise ValueError(f"embedding_dim: must be >= 1, got {self.embedding_dim}")
        if self.num_tables < 1 or self.num_dense < 0:
            raise ValueError(f"num_tables/num_dense: need >= 1 table, got {self.num_tables}/{self.num_dense}")
        if not is_builtin(self.name):
            model_class(self.name)  # (ValueError: what is wrong with the class, or its import)
            # the built-ins' sizes mean nothing to it: as declared, so that equal models compare equal
            declared = {f.name: f.default for f in fields(self)}
            for size in ("bottom_mlp", "top_mlp", "deep_mlp", "cross_layers"):
                object.__setattr__(self, size, declared[size])
            return
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
        return first_order(self.name)

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
        if not is_builtin(self.name):
            return {"model": self.name}
        if self.name == "dlrm":
            return {"model": "dlrm", "bottom_mlp": list(self.bottom_mlp), "top_mlp": list(self.top_mlp)}
        out: dict[str, object] = {"model": self.name, "deep_mlp": list(self.deep_mlp)}
        if self.name == "dcn":
            out["cross_layers"] = self.cross_layers
        return out
