"""zerograph's graph passes: each a function ``(gm, ctx) -> PassResult`` in a file of its own."""
from .context import PassContext, PassResult
from .insert_allgather import insert_allgather
from .insert_reduce_scatter import insert_reduce_scatter
from .manager import pipeline, run_pipeline

__all__ = ["PassContext", "PassResult", "insert_allgather", "insert_reduce_scatter", "pipeline", "run_pipeline"]
