"""Two-batch-overlap attention backend: a primary for the whole batch + one child per micro-batch.

SGLang's ``TboAttnBackend`` behaviour, with metadata returned instead of stored:

* ``init_forward_metadata(batch, children)`` builds the primary's metadata for the full batch
  and, when the step runs TBO (``children`` from ``split_batch``), each child's metadata on
  the matching child backend. The children backends have their own, smaller static capacity
  (the TBO child capacity chosen by the caller). An empty child (``batch_size == 0``) gets
  empty metadata instead of being skipped, so the result has the same pytree structure on
  every step and every DP rank (it stacks along a dp axis and never retraces).
* ``forward`` and anything else delegate to the primary; the overlap executor runs
  micro-batch ``i`` with ``backend.children[i].forward`` and ``metadata.children[i]``, threading
  the KV cache through A's attention and then B's.
"""

import dataclasses
from collections.abc import Callable, Sequence

import jax

from jtbo.attention import metadata as metadata_lib
from jtbo.split import batch as batch_lib


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TboAttnMetadata:
    """Metadata of a TBO step.

    Attributes:
      primary: metadata of the full batch.
      children: metadata of micro-batches A and B, or None when the step runs without TBO.
    """

    primary: metadata_lib.AttentionMetadata
    children: tuple[metadata_lib.AttentionMetadata, metadata_lib.AttentionMetadata] | None


class TboAttnBackend:
    """A primary backend for the whole batch and two child backends, one per micro-batch.

    Attributes:
      primary: backend of the full batch.
      children: backends of micro-batches A and B.
    """

    def __init__(self, primary, children: Sequence):
        """Wraps backends.

        Args:
          primary: backend for the full batch (``init_forward_metadata``, ``forward``, ...).
          children: exactly two backends, for micro-batches A and B.

        Raises:
          ValueError: not exactly two children.
        """
        if len(children) != 2:
            raise ValueError(f"TboAttnBackend needs 2 children, got {len(children)}")
        self.primary = primary
        self.children = tuple(children)

    @classmethod
    def init_new(
        cls,
        creator: Callable[[metadata_lib.AttentionCapacity], object],
        *,
        capacity: metadata_lib.AttentionCapacity,
        child_capacity: metadata_lib.AttentionCapacity,
    ) -> "TboAttnBackend":
        """Creates the primary at ``capacity`` and both children at ``child_capacity``.

        Args:
          creator: builds a backend for a capacity (e.g. ``NativeAttnBackend``).
          capacity: static sizes of the full batch.
          child_capacity: static sizes of one micro-batch.

        Returns:
          A ``TboAttnBackend``.
        """
        return cls(creator(capacity), [creator(child_capacity) for _ in range(2)])

    def _child_metadata(self, child, child_batch: batch_lib.ForwardBatch):
        if child_batch.batch_size == 0:
            return child.empty_metadata()
        return child.init_forward_metadata(child_batch)

    def init_forward_metadata(
        self,
        batch: batch_lib.ForwardBatch,
        children: Sequence[batch_lib.ForwardBatch] | None = None,
    ) -> TboAttnMetadata:
        """Builds metadata for the full batch and, with TBO, for each child batch.

        Args:
          batch: the step's host batch.
          children: the two child batches from ``split_batch``, or None without TBO.

        Returns:
          ``TboAttnMetadata``.

        Raises:
          ValueError: not two children, or a batch that does not fit its backend.
        """
        primary = self.primary.init_forward_metadata(batch)
        if children is None:
            return TboAttnMetadata(primary=primary, children=None)
        return TboAttnMetadata(primary=primary, children=self.init_children_metadata(children))

    def init_children_metadata(
        self, children: Sequence[batch_lib.ForwardBatch]
    ) -> tuple[metadata_lib.AttentionMetadata, metadata_lib.AttentionMetadata]:
        """Builds each child's metadata only (a step that runs every layer per micro-batch
        never reads the primary's).

        Args:
          children: the two child batches from ``split_batch``.

        Returns:
          ``(A's metadata, B's metadata)``; an empty child gets empty metadata.

        Raises:
          ValueError: not two children, or a child that does not fit its backend.
        """
        if len(children) != 2:
            raise ValueError(f"TBO needs 2 child batches, got {len(children)}")
        pairs = zip(self.children, children, strict=True)
        return tuple(self._child_metadata(c, b) for c, b in pairs)

    def forward(self, *args, **kwargs):
        """Attention over the full batch: the primary's ``forward``."""
        return self.primary.forward(*args, **kwargs)

    def __getattr__(self, name: str):
        # Reached only when normal lookup fails; guard against recursion before __init__ ran.
        if name in ("primary", "children"):
            raise AttributeError(name)
        return getattr(self.primary, name)
