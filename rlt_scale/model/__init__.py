"""The RLT model: math only, no distributed plumbing beyond the TP factories."""

from rlt_scale.model.rlt import RLT
from rlt_scale.model.state import KV, DecoderState
from rlt_scale.model.tp import TensorParallel

__all__ = ["RLT", "KV", "DecoderState", "TensorParallel", "build_model"]


def build_model(cfg, tp_group, parts=None) -> RLT:
    """Build the RLT for ``cfg`` (a ModelConfig) on the given tensor-parallel group.

    ``parts`` (a predicate on part names, see :class:`RLT`) builds only some
    parts, e.g. one pipeline stage's.
    """
    applied_depth = cfg.n_enc_layers + cfg.n_dec_layers
    tp = TensorParallel.build(tp_group, cfg.params_dtype, cfg.init_std, applied_depth)
    return RLT(cfg, tp, parts)
