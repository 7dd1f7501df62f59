"""Pipeline-parallel stages for converted models (torch.distributed.pipelining).

Three entry points:

* :func:`split` (also ``convert(..., pipeline_stages=P)``) places P-1 ``torch.ops.pippy._pipe_split`` nodes in both
  graphs of a converted model (training and eval), so ``torch.distributed.pipelining.pipeline(model, mb_args)``
  splits it without further hints. Cuts are placed before a sublayer, balanced by parameter count, and for Block
  schemes only at block boundaries (where the depth state is smallest).
* :func:`stages` returns the P stage modules for users who build ``PipelineStage`` objects by hand: stage ``s`` takes
  exactly what stage ``s-1`` returns (explicit tensors, static shapes) and keeps the original parameter names.
* ``stages(..., ranks=R)`` with R < P (several stages per rank, "loop" placement: stage s on rank s % R) adds
  **cross-stage caching**: a rank keeps the completed depth summaries it already holds for a micro-batch and the next
  stage on that rank receives only the new ones (the backward gradient for a cached summary is deposited in the rank
  cache and added by the stage that first held it).

What crosses a boundary is the scheme's depth state (Block AttnRes / Block MSAR: completed block summaries plus the
open partial sum; Full AttnRes: every source so far; mHC: the n streams; MoDA: the residual stream and the depth
slots) plus any *side input*: a value computed once at the graph top (RoPE cos/sin, the attention mask, position ids)
that later stages also read. Side values that depend only on shapes and buffers (RoPE, a causal mask built from the
sequence length) are **recomputed** in every stage that reads them (a copy of their computation is placed in that
stage); side values that depend on input data (a padding ``attention_mask`` passed in) are **sent** and reported.
See docs/pipelines.md.
"""

from __future__ import annotations

from .cache import CachedStage, RankCache
from .measure import boundary_info
from .nodes import PIPE_SPLIT
from .place import split
from .plan import plan
from .records import Boundary, Crossing, PipelineInfo
from .stages import contiguous_grad, stages

__all__ = [
    "PIPE_SPLIT",
    "contiguous_grad",
    "Boundary",
    "Crossing",
    "PipelineInfo",
    "RankCache",
    "CachedStage",
    "plan",
    "split",
    "stages",
    "boundary_info",
]
